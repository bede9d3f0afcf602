"""The prompt transform and reward functions of the llama-3.2-1b-grpo-gsm8k example.

`gsm8k` turns GSM8K rows (`question`, `answer` ending in `#### N`) into prompt rows with the number alone in
`answer`; `correct_answer` and `answer_format` score each completion (docs/rl.md)."""

import re

INSTRUCTION = "Solve the problem step by step. End with a last line `#### N`, where N is the final number alone."
FINAL_LINE = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def gsm8k(cfg, dataset_idx=0, **kwargs):
    def transform(row):
        return {
            "prompt": [
                {"role": "system", "content": INSTRUCTION},
                {"role": "user", "content": row["question"]},
            ],
            "answer": row["answer"].split("####")[-1].strip().replace(",", ""),
        }

    return transform, {"remove_columns": ["question"]}


def _text(completion):
    """A conversational completion is a list of messages; a plain one is a string."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct_answer(prompts, completions, answer, **kwargs):
    """1 where the final `#### N` line gives the reference number, else 0."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        found = FINAL_LINE.search(_text(completion).strip())
        given = found.group(1).replace(",", "") if found else None
        scores.append(1.0 if given is not None and float(given) == float(expected) else 0.0)
    return scores


def answer_format(prompts, completions, **kwargs):
    """0.2 where the completion ends with a `#### N` line, whatever the number: the format is learned first."""
    return [0.2 if FINAL_LINE.search(_text(completion).strip()) else 0.0 for completion in completions]
