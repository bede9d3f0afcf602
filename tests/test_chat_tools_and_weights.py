"""Chat rows beyond plain text turns: tool calls and tool results, per-message `weight`, `content: null`, and the
render budget that refuses chat templates that never end or render without bound."""

from __future__ import annotations

import time

import pytest

from hellbender.data.formats import render_budget
from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, RowError
from hellbender.data.formats.chat_template import tokenize_row
from hellbender.errors import ConfigError

# Tool use in the manner of Qwen 2.5's format: the tool list in a system turn, each call as JSON between
# <tool_call> tags in the assistant turn, tool results in a user turn between <tool_response> tags.
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{ '\\n' + tool | tojson }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{%- if message.content %}{{ '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    '{{ \'\\n<tool_call>{"name": "\' + call.function.name + \'", "arguments": \' + call.function.arguments | tojson'
    " + '}</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
# The same format without tool calls: an assistant turn is its content only.
NO_TOOLS_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
TOOL_ROW = {
    "tools": [ADD],
    "messages": [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "5", "name": "add"},
        {"role": "assistant", "content": "It is 5."},
    ],
}


def context(tokenizer, template: str = TOOL_TEMPLATE, **overrides) -> FormatContext:
    settings = dict(
        tokenizer=tokenizer,
        train_on_inputs=False,
        chat_template=template,
        field_messages=None,
        role_key="role",
        content_key="content",
        role_map=None,
        roles_to_train=("assistant",),
        train_on_eos="turn",
        eot_ids=frozenset(),
        drop_system_message=False,
        text_field=None,
        vision=None,
        template_source="`chat_template_jinja`",
        tools_field="tools",
    )
    return FormatContext(**{**settings, **overrides})


def rendered_and_trained(tokenizer, row, ctx) -> tuple[str, list[str]]:
    """The whole rendered text, and each run of consecutive trained tokens, decoded."""
    out = tokenize_row(row, ctx)
    runs, run = [], []
    for token, label in zip(out["input_ids"], out["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    if run:
        runs.append(tokenizer.decode(run))
    return tokenizer.decode(out["input_ids"]), runs


# ---------------------------------------------------------------- tool calls


def test_tool_calls_and_tools_are_rendered_and_the_calls_trained(tiny_tokenizer):
    text, trained = rendered_and_trained(tiny_tokenizer, TOOL_ROW, context(tiny_tokenizer))
    assert text == (
        '<|im_start|>system\nTools:\n{"type": "function", "function": {"name": "add", "parameters": {"type": '
        '"object"}}}<|im_end|>\n'
        "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 5.<|im_end|>\n"
    )
    # The call's text with its markup (the model writes it all) and its end-of-turn token; the tool result is not
    # trained, nor any header.
    assert trained == [
        '\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
        "It is 5.<|im_end|>",
    ]


def test_tool_results_are_trained_only_when_tool_is_a_trained_role(tiny_tokenizer):
    ctx = context(tiny_tokenizer, roles_to_train=("assistant", "tool"))
    _, trained = rendered_and_trained(tiny_tokenizer, TOOL_ROW, ctx)
    assert trained[1] == "5"
    assert len(trained) == 3


def test_a_template_that_drops_tool_calls_is_refused_for_the_row(tiny_tokenizer):
    with pytest.raises(RowError, match=r"does not render the tool calls of message 1 \(assistant\)"):
        tokenize_row(TOOL_ROW, context(tiny_tokenizer, NO_TOOLS_TEMPLATE))


def test_arguments_given_as_objects_lose_the_nulls_arrow_adds(tiny_tokenizer):
    call = {"type": "function", "id": None, "function": {"name": "add", "arguments": {"a": 2, "b": 3, "c": None}}}
    row = {**TOOL_ROW, "messages": [TOOL_ROW["messages"][0], {"role": "assistant", "tool_calls": [call]}]}
    text, _ = rendered_and_trained(tiny_tokenizer, row, context(tiny_tokenizer))
    assert '"arguments": {"a": 2, "b": 3}}' in text


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{a: 2"}}]}, "not valid JSON"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "has no function name"),
        ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "only assistant messages call tools"),
    ],
)
def test_bad_tool_calls_are_refused(tiny_tokenizer, message, words):
    row = {"messages": [{"role": "user", "content": "Add."}, message]}
    with pytest.raises(RowError, match=words):
        tokenize_row(row, context(tiny_tokenizer))


# ---------------------------------------------------------------- weights and null contents


def conversation(*weights):
    turns = [("user", "Hi."), ("assistant", "Hello."), ("user", "Bye."), ("assistant", "Goodbye.")]
    return {
        "messages": [
            {"role": role, "content": text, **({} if weight is None else {"weight": weight})}
            for (role, text), weight in zip(turns, weights, strict=True)
        ]
    }


def test_weight_zero_leaves_a_turn_untrained_and_one_trains_any_role(tiny_tokenizer):
    ctx = context(tiny_tokenizer, NO_TOOLS_TEMPLATE)
    assert rendered_and_trained(tiny_tokenizer, conversation(None, None, None, None), ctx)[1] == [
        "Hello.<|im_end|>",
        "Goodbye.<|im_end|>",
    ]
    assert rendered_and_trained(tiny_tokenizer, conversation(None, 0, None, 1.0), ctx)[1] == ["Goodbye.<|im_end|>"]
    assert rendered_and_trained(tiny_tokenizer, conversation(1, 0, None, None), ctx)[1] == [
        "Hi.<|im_end|>",
        "Goodbye.<|im_end|>",
    ]


@pytest.mark.parametrize("weight", [0.5, 2, "0", True])
def test_other_weights_are_refused(tiny_tokenizer, weight):
    with pytest.raises(RowError, match=r"message 1 has `weight: .*`; a message's weight is 0 .* or 1"):
        tokenize_row(conversation(None, weight, None, None), context(tiny_tokenizer, NO_TOOLS_TEMPLATE))


def test_weight_zero_cannot_be_honoured_with_train_on_inputs(tiny_tokenizer):
    ctx = context(tiny_tokenizer, NO_TOOLS_TEMPLATE, train_on_inputs=True)
    with pytest.raises(RowError, match="message 1 has `weight: 0`, but `train_on_inputs: true`"):
        tokenize_row(conversation(None, 0, None, None), ctx)


def test_null_content_is_refused_except_beside_tool_calls(tiny_tokenizer):
    row = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": None}]}
    with pytest.raises(RowError, match=r'message 1 \(assistant\) has `content: null`.*`content: ""` for an empty'):
        tokenize_row(row, context(tiny_tokenizer))
    tokenize_row(TOOL_ROW, context(tiny_tokenizer))  # the same null beside tool calls: the turn is the calls


# ---------------------------------------------------------------- the render budget

ROW = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
NEVER_ENDS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
EXPONENTIAL = "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}"
ENORMOUS = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"


@pytest.mark.parametrize("template", [NEVER_ENDS, EXPONENTIAL], ids=["nested-ranges", "exponential-macro"])
def test_a_template_that_never_ends_is_refused_naming_its_source(tiny_tokenizer, monkeypatch, template):
    monkeypatch.setattr(render_budget, "RENDER_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"The chat template \(`chat_template_jinja`\) is refused: .* 0.5 seconds"):
        tokenize_row(ROW, context(tiny_tokenizer, template))
    assert time.monotonic() - start < 5


def test_a_template_whose_output_has_no_bound_is_refused(tiny_tokenizer):
    with pytest.raises(ConfigError, match="grew past 67,108,864 characters"):
        tokenize_row(ROW, context(tiny_tokenizer, ENORMOUS))


def test_the_budget_applies_only_to_budgeted_renders(tiny_tokenizer, monkeypatch):
    """After a refused render, the same template still renders unbounded elsewhere (inference calls transformers
    directly), and a good template renders within the budget as before."""
    monkeypatch.setattr(render_budget, "RENDER_SECONDS", 0.0)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="took more than 0 seconds"):
        tokenize_row(ROW, context(tiny_tokenizer, template))
    assert tiny_tokenizer.apply_chat_template(ROW["messages"], chat_template=template, tokenize=False) == "Hi.Hello."
    monkeypatch.setattr(render_budget, "RENDER_SECONDS", 10.0)
    assert tokenize_row(ROW, context(tiny_tokenizer, template))["input_ids"]
