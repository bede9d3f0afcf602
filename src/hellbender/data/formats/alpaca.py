"""`type: alpaca`: instruction / input / output rows in the Alpaca prompt layout.

The prompt (and input) are masked unless `train_on_inputs`; the output and the EOS token are trained.
"""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, require_eos, text_value

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def build_prompt(instruction: str, input_text: str) -> str:
    if input_text:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    instruction = text_value(row, "instruction")
    input_text = text_value(row, "input") if "input" in row else ""
    output = text_value(row, "output")
    tok = ctx.tokenizer
    # Prompt and response are tokenized apart so the boundary between them is exact.
    prompt_ids = tok(build_prompt(instruction, input_text), add_special_tokens=True)["input_ids"]
    response_ids = tok(output, add_special_tokens=False)["input_ids"] + [require_eos(tok)]
    prompt_labels = list(prompt_ids) if ctx.train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
    return {"input_ids": prompt_ids + response_ids, "labels": prompt_labels + response_ids}
