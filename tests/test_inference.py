"""`hellbender inference`: greedy answers are deterministic and equal to plain transformers' greedy generation with
base + adapter; chat keeps the conversation; images reach vision-language models; tokens are streamed."""

from __future__ import annotations

import json
from pathlib import Path

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import torch

from tests.helpers import assert_user_error, invoke
from tests.test_multimodal_training import square
from tests.trained_runs import base_model_dir, load_with_peft

MAX_NEW = 12
QUESTION = "What is 5 plus 9?"


def answer_of(*args) -> str:
    result = invoke("inference", *args, "--max-new-tokens", MAX_NEW)
    assert result.exit_code == 0, result.output
    return result.stdout


def reference_answer(model, tokenizer, messages: list[dict], **processor_inputs) -> str:
    """Greedy generation with plain transformers, stopping at EOS or the ChatML end of turn."""
    batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def text_reference(trained_text_lora):
    from transformers import AutoTokenizer

    return load_with_peft(trained_text_lora), AutoTokenizer.from_pretrained(trained_text_lora.output_dir)


def test_a_greedy_answer_is_deterministic_and_is_plain_greedy_generation(trained_text_lora, text_reference):
    first = answer_of(trained_text_lora.config, "--prompt", QUESTION)
    assert first.strip(), "empty answer"
    assert answer_of(trained_text_lora.config, "--prompt", QUESTION) == first
    model, tokenizer = text_reference
    assert first.strip() == reference_answer(model, tokenizer, [{"role": "user", "content": QUESTION}])


def test_the_merged_model_and_a_checkpoint_answer_like_their_adapters(trained_text_lora, text_reference, tmp_path):
    from transformers import AutoTokenizer

    run = trained_text_lora
    merged = tmp_path / "merged"
    assert invoke("merge-lora", run.config, "--output", merged).exit_code == 0
    assert answer_of(run.config, "-p", QUESTION, "--model", merged) == answer_of(run.config, "-p", QUESTION)
    checkpoint = run.output_dir / "checkpoint-10"
    expected = reference_answer(
        load_with_peft(run, checkpoint),
        AutoTokenizer.from_pretrained(checkpoint),
        [{"role": "user", "content": QUESTION}],
    )
    assert answer_of(run.config, "-p", QUESTION, "--checkpoint", checkpoint).strip() == expected


def test_a_prompts_file_answers_each_prompt_on_its_own(trained_text_lora, text_reference, tmp_path):
    prompts = ["What is 5 plus 9?", "Reverse the words: quiet green music"]
    plain = tmp_path / "prompts.txt"
    plain.write_text(f"{prompts[0]}\n\n{prompts[1]}\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    model, tokenizer = text_reference
    expected = "".join(
        f"### {p}\n{reference_answer(model, tokenizer, [{'role': 'user', 'content': p}])}\n\n" for p in prompts
    )
    for path in (plain, jsonl):
        output = answer_of(trained_text_lora.config, "--prompts-file", path)
        assert [line.strip() for line in output.splitlines()] == [line.strip() for line in expected.splitlines()]


def test_chat_keeps_the_conversation_and_reset_starts_over(trained_text_lora, text_reference):
    from typer.testing import CliRunner

    from hellbender.cli import app

    run = trained_text_lora
    result = CliRunner().invoke(
        app,
        ["inference", str(run.config), "--chat", "--system", "Be brief.", "--max-new-tokens", str(MAX_NEW)],
        input="What is 2 plus 2?\nAnd 3 plus 3?\n/reset\nAnd 3 plus 3?\n/exit\nnever read\n",
    )
    assert result.exit_code == 0, result.output
    model, tokenizer = text_reference
    system = {"role": "system", "content": "Be brief."}
    first = reference_answer(model, tokenizer, [system, {"role": "user", "content": "What is 2 plus 2?"}])
    history = [
        system,
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And 3 plus 3?"},
    ]
    second = reference_answer(model, tokenizer, history)
    fresh = reference_answer(model, tokenizer, [system, {"role": "user", "content": "And 3 plus 3?"}])
    replies = [r.strip() for r in result.stdout.split("> ") if r.strip() and "new conversation" not in r]
    assert replies == [first, second, fresh]
    assert second != fresh  # the history changed the answer, so the comparison above tests it


def test_answers_are_streamed_token_by_token(trained_text_lora):
    from hellbender.config import load_config
    from hellbender.use.inference import GenerationSettings, Generator, answer

    generator = Generator(load_config(trained_text_lora.config))
    chunks: list[str] = []
    reply = answer(generator, QUESTION, [], GenerationSettings(max_new_tokens=MAX_NEW), write=chunks.append)
    assert len(chunks) > 2  # written while generating, not once at the end
    assert "".join(chunks).strip() == reply


def test_sampling_follows_the_temperature(trained_text_lora):
    from transformers import GenerationConfig

    from hellbender.use.inference import GenerationSettings

    greedy = GenerationSettings().apply(GenerationConfig(do_sample=True, temperature=0.7, top_k=20))
    assert not greedy.do_sample and greedy.temperature is None and greedy.top_k is None
    sampled = GenerationSettings(max_new_tokens=5, temperature=0.8, top_p=0.9).apply(GenerationConfig())
    assert sampled.do_sample and sampled.temperature == 0.8 and sampled.top_p == 0.9 and sampled.max_new_tokens == 5


def test_a_vlm_answers_about_the_image(trained_vlm_lora):
    from hellbender.config import validate_config
    from hellbender.models.loading import load_tokenizer_and_processor

    run = trained_vlm_lora
    image_path = run.output_dir.parent / "red.png"
    square("red", 4, 4).save(image_path)
    question = "What colour is the square?"
    first = answer_of(run.config, "-p", question, "--image", image_path)
    assert first.strip() and answer_of(run.config, "-p", question, "--image", image_path) == first

    _, processor = load_tokenizer_and_processor(validate_config(dict(run.raw)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = processor(text=[prompt], images=[[square("red", 4, 4)]], add_special_tokens=False, return_tensors="pt")
    tokenizer = processor.tokenizer
    with torch.no_grad():
        out = load_with_peft(run).generate(
            **batch,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
            pad_token_id=tokenizer.pad_token_id,
        )
    expected = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert first.strip() == expected


# ------------------------------------------------------------------------------------------------ errors


def test_an_image_for_a_text_only_model_is_refused(trained_text_lora, tmp_path):
    image = tmp_path / "red.png"
    square("red", 0, 0).save(image)
    result = invoke("inference", trained_text_lora.config, "-p", "hi", "--image", image)
    assert_user_error(result, "--image", "vision-language model", "text-only")


def test_a_missing_image_is_refused(trained_vlm_lora, tmp_path):
    result = invoke("inference", trained_vlm_lora.config, "-p", "hi", "--image", tmp_path / "none.png")
    assert_user_error(result, "--image", "none.png", "does not exist")


@pytest.mark.parametrize(
    "args, needles",
    [
        ([], ["Nothing to answer", "--prompt"]),
        (["-p", "hi", "--prompts-file", "p.txt"], ["one of"]),
        (["--chat", "--raw"], ["--raw", "--chat"]),
        (["-p", "hi", "--temperature", "-1"], ["--temperature"]),
        (["-p", "hi", "--top-p", "0"], ["--top-p"]),
        (["--prompts-file", "missing.txt"], ["missing.txt", "does not exist"]),
    ],
)
def test_bad_options_are_refused(trained_text_lora, args, needles):
    assert_user_error(invoke("inference", trained_text_lora.config, *args), *needles)


def test_a_model_directory_that_is_not_a_checkpoint_is_refused(trained_text_lora, tmp_path):
    result = invoke("inference", trained_text_lora.config, "-p", "hi", "--model", base_model_dir(trained_text_lora))
    assert_user_error(result, "--model", "not a complete checkpoint", "hellbender_model.json")


def test_a_run_that_has_not_finished_is_refused(trained_text_lora, tmp_path):
    unfinished = tmp_path / "out"
    unfinished.mkdir()
    result = invoke("inference", trained_text_lora.config, "-p", "hi", "--set", f"output_dir={unfinished}")
    assert_user_error(result, "holds no complete trained model", "hellbender train")


def test_raw_prompts_skip_the_chat_template(trained_text_lora, text_reference):
    model, tokenizer = text_reference
    text = "Document number 3 is about"
    batch = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        )
    expected = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert answer_of(trained_text_lora.config, "-p", text, "--raw").strip() == expected


def test_prompts_file_lines_must_hold_prompts(trained_text_lora, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert_user_error(invoke("inference", trained_text_lora.config, "--prompts-file", bad), "line 2", '"prompt"')
    assert Path(bad).is_file()
