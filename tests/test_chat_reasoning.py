"""Reasoning in chat rows (`field_thinking`, `template_thinking_key`): handed to the template under its name,
rendered where the template puts it, and trained with its message.

The template below follows gpt-oss's published harmony format: every message is `<|start|>role<|message|>...<|end|>`;
an assistant answer is written in the `final` channel, and only the conversation's last assistant message (during
training) also writes its reasoning, before the answer, in the `analysis` channel, and ends with `<|return|>`.
"""

from __future__ import annotations

import pytest

from hellbender.config import validate_config
from hellbender.data.contexts import format_context
from hellbender.data.formats import FORMATTERS, RowError
from hellbender.errors import ConfigError
from hellbender.models.tiny import build_tiny_tokenizer

IGNORE = -100
HARMONY_MARKERS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>")


def harmony_template(key: str) -> str:
    return (
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}"
        "{%- if loop.last and not add_generation_prompt %}"
        "{%- if '" + key + "' in message %}"
        "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message['" + key + "'] + '<|end|>' }}"
        "{%- endif %}"
        "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|return|>' }}"
        "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
        "{%- endif %}"
        "{%- else %}{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
    )


def harmony_tokenizer():
    tok = build_tiny_tokenizer(extra_special_tokens=HARMONY_MARKERS)
    tok.eos_token = "<|return|>"  # gpt-oss's EOS ends the last answer
    return tok


def prepare(messages, key: str = "thinking", template: str | None = None, **entry):
    tok = harmony_tokenizer()
    cfg = validate_config(
        {
            "base_model": "hellbender/tiny-llama",
            "datasets": [
                {
                    "path": "x.jsonl",
                    "type": "chat_template",
                    "chat_template": "jinja",
                    "chat_template_jinja": template or harmony_template(key),
                    **entry,
                }
            ],
            "eot_tokens": ["<|end|>"],
        }
    )
    ctx = format_context(cfg.datasets[0], cfg, tok)
    return tok, FORMATTERS["chat_template"]({"messages": messages}, ctx)


def expected(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    return ids, labels


def test_the_reasoning_is_rendered_in_the_analysis_channel_and_trained_with_its_answer():
    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four.", "thinking": "Add two and two."},
    ]
    tok, out = prepare(messages, field_thinking="thinking", template_thinking_key="thinking")
    assert tok.decode(out["input_ids"]) == (
        "<|start|>user<|message|>What is two plus two?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Add two and two.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Four.<|return|>"
    )
    # The reasoning, the markup that closes it and opens the answer, the answer and its EOS are trained; the
    # turn's opening `<|start|>assistant<|channel|>analysis<|message|>` is the prompt's.
    assert (out["input_ids"], out["labels"]) == expected(
        tok,
        [
            ("<|start|>user<|message|>What is two plus two?<|end|>", False),
            ("<|start|>assistant<|channel|>analysis<|message|>", False),
            ("Add two and two.", True),
            ("<|end|><|start|>assistant<|channel|>final<|message|>", True),
            ("Four.", True),
            ("<|return|>", True),
        ],
    )


def test_reasoning_the_template_leaves_out_of_earlier_answers_is_not_trained():
    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four.", "thinking": "Add them."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six.", "thinking": "Add again."},
    ]
    tok, out = prepare(messages, field_thinking="thinking", template_thinking_key="thinking")
    assert "Add them." not in tok.decode(out["input_ids"])
    assert (out["input_ids"], out["labels"]) == expected(
        tok,
        [
            ("<|start|>user<|message|>What is two plus two?<|end|>", False),
            ("<|start|>assistant<|channel|>final<|message|>", False),
            ("Four.<|end|>", True),  # `eot_tokens: [<|end|>]` ends the earlier answer
            ("<|start|>user<|message|>And three plus three?<|end|>", False),
            ("<|start|>assistant<|channel|>analysis<|message|>", False),
            ("Add again.<|end|><|start|>assistant<|channel|>final<|message|>Six.<|return|>", True),
        ],
    )


def test_a_message_without_reasoning_renders_as_before():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "thinking": None}]
    tok, out = prepare(messages, field_thinking="thinking", template_thinking_key="thinking")
    assert tok.decode(out["input_ids"]) == (
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello<|return|>"
    )
    assert tok.decode([t for t in out["labels"] if t != IGNORE]) == "Hello<|return|>"


def test_the_default_keys_are_axolotls_reasoning_content():
    cfg = validate_config(
        {"base_model": "hellbender/tiny-llama", "datasets": [{"path": "x.jsonl", "type": "chat_template"}]}
    )
    entry = cfg.datasets[0]
    assert (entry.field_thinking, entry.template_thinking_key) == ("reasoning_content", "reasoning_content")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."},
    ]
    tok, out = prepare(messages, template=harmony_template("reasoning_content"))
    assert tok.decode([t for t in out["labels"] if t != IGNORE]) == (
        "Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello<|return|>"
    )


def test_a_field_read_under_another_name_reaches_the_template_under_template_thinking_key():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "trace": "Greet."}]
    tok, out = prepare(messages, field_thinking="trace", template_thinking_key="thinking")
    assert "<|channel|>analysis<|message|>Greet.<|end|>" in tok.decode(out["input_ids"])


def test_a_template_that_never_renders_the_reasoning_is_refused_naming_the_key():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "thinking": "Greet."}]
    # The template reads `thinking`; the config hands the reasoning over as `cot`. (transformers itself copies
    # reasoning between `reasoning_content`, `thinking` and `reasoning`, so those names would reach it.)
    with pytest.raises(ConfigError, match=r"given to it as `cot`, set by `template_thinking_key`"):
        prepare(messages, field_thinking="thinking", template_thinking_key="cot")


def test_reasoning_that_is_not_text_is_refused_for_the_row():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "thinking": ["a"]}]
    with pytest.raises(RowError, match="message 1 has `thinking`"):
        prepare(messages, field_thinking="thinking", template_thinking_key="thinking")


def test_template_thinking_key_cannot_be_the_content():
    with pytest.raises(ConfigError, match="template_thinking_key"):
        validate_config(
            {
                "base_model": "hellbender/tiny-llama",
                "datasets": [{"path": "x.jsonl", "type": "chat_template", "template_thinking_key": "content"}],
            }
        )
