"""The faster chat tokenization computes what the plain one computes.

Preparing a dataset renders each placeholder conversation once per shape (`placeholder_memo`), reads token offsets
from the tokenizer's encoding one token at a time (`EncodingOffsets`) and hands rows to `datasets` in batches. Each
test here holds one of those against the plain computation: a fresh placeholder rendering per row, the whole offset
list, one row at a time.
"""

from __future__ import annotations

import copy

import datasets
import pytest

from hellbender.config import validate_config
from hellbender.data import tokenize
from hellbender.data.contexts import format_context
from hellbender.data.formats import RowError, chat_template
from hellbender.data.formats.chat_template import (
    EncodingOffsets,
    encode_plain,
    read_messages,
    render_with_spans,
    tokenize_row,
    tokenizer_renderer,
)
from hellbender.data.formats.placeholder_memo import remembered
from hellbender.errors import DataError

IGNORE = -100
# Two rows of each shape, answers that repeat the template's own words, a think block, a system message.
ROWS = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
    {"messages": [{"role": "user", "content": "user"}, {"role": "assistant", "content": "assistant"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And three?"},
            {"role": "assistant", "content": " Six, with spaces around. "},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "<|im_start|>"},
            {"role": "user", "content": "im_end"},
            {"role": "assistant", "content": "\n"},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Yes 🙂 again."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "<think>plan</think>Because."},
        ]
    },
]
# A template that writes the bos token (when the tokenizer has one) and trims contents.
TRIMMING = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
)


def context(tok, **entry):
    cfg = validate_config({"base_model": "hellbender/tiny-llama", "datasets": [{"path": "x.jsonl", **entry}]})
    return format_context(cfg.datasets[0], cfg, tok)


def rendered_fresh(monkeypatch, row, ctx):
    """`tokenize_row` with every placeholder conversation rendered anew (the plain computation)."""
    with monkeypatch.context() as patch:
        patch.setattr(chat_template, "remembered", lambda render, scope: render)
        return tokenize_row(row, ctx)


@pytest.mark.parametrize("entry", [{}, {"chat_template": "jinja", "chat_template_jinja": TRIMMING}])
def test_rows_labelled_with_remembered_placeholder_renderings_equal_fresh_ones(monkeypatch, tiny_tokenizer, entry):
    ctx = context(tiny_tokenizer, type="chat_template", roles_to_train=["assistant"], train_on_eos="turn", **entry)
    for _ in range(2):  # the second pass finds every shape remembered
        for row in ROWS:
            assert tokenize_row(row, ctx) == rendered_fresh(monkeypatch, row, ctx)


def test_tokenizers_with_other_special_tokens_do_not_share_renderings(monkeypatch, tiny_tokenizer):
    with_bos = copy.deepcopy(tiny_tokenizer)
    with_bos.add_special_tokens({"bos_token": "<|bos|>"})
    plain = context(tiny_tokenizer, type="chat_template", chat_template="jinja", chat_template_jinja=TRIMMING)
    bos = context(with_bos, type="chat_template", chat_template="jinja", chat_template_jinja=TRIMMING)
    for row in ROWS[:2]:
        without, withbos = tokenize_row(row, plain), tokenize_row(row, bos)
        assert withbos["input_ids"][0] == with_bos.convert_tokens_to_ids("<|bos|>")
        assert without["input_ids"][0] != withbos["input_ids"][0]
        assert without == rendered_fresh(monkeypatch, row, plain)
        assert withbos == rendered_fresh(monkeypatch, row, bos)


def test_each_shape_is_rendered_with_placeholders_once(tiny_tokenizer):
    ctx = context(tiny_tokenizer, type="chat_template")
    calls: list[list[dict]] = []
    real = tokenizer_renderer(tiny_tokenizer, ctx.chat_template)

    def counting(messages):
        calls.append(messages)
        return real(messages)

    scope = ("a scope no other test uses",)
    for content in ("One.", "Two.", "Three."):
        messages = read_messages(
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content}]}, ctx
        )
        render_with_spans(real, messages, None, remembered(counting, scope))
    assert len(calls) == 1


def test_a_remembered_rendering_that_does_not_fit_is_rendered_again(tiny_tokenizer):
    ctx = context(tiny_tokenizer, type="chat_template")
    render = tokenizer_renderer(tiny_tokenizer, ctx.chat_template)
    messages = read_messages(ROWS[2], ctx)
    stale = render_with_spans(render, messages, None, lambda placeholders: "<|im_start|>other markup")
    assert stale == render_with_spans(render, messages)


def test_a_template_that_rewrites_contents_is_still_refused(tiny_tokenizer):
    upper = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
    ctx = context(tiny_tokenizer, type="chat_template", chat_template="jinja", chat_template_jinja=upper)
    for _ in range(2):
        with pytest.raises(RowError, match="does not render message contents verbatim"):
            tokenize_row(ROWS[0], ctx)


def test_renderings_are_remembered_per_scope():
    messages = [{"role": "user", "content": "hbmsg0q"}]
    first = remembered(lambda m: "first", ("scope test", 1))
    second = remembered(lambda m: "second", ("scope test", 2))
    assert [first(messages), second(messages), first(messages)] == ["first", "second", "first"]


def test_conversations_holding_other_than_plain_data_are_not_remembered():
    class Opaque:
        def __repr__(self) -> str:
            return "Opaque()"

    calls = []
    render = remembered(lambda messages: calls.append(1) or "text", ("scope of the opaque test",))
    for _ in range(2):
        render([{"role": "user", "content": "x", "extra": Opaque()}])
    assert len(calls) == 2
    for _ in range(2):
        render([{"role": "user", "content": "x", "extra": "Opaque()"}])
    assert len(calls) == 3


def test_encoding_offsets_read_what_the_offset_mapping_holds(tiny_tokenizer):
    text = "<|im_start|>user\nnaïve 🙂 text<|im_end|>\n<|im_start|>assistant\n  spaced  <|im_end|>\n"
    enc = tiny_tokenizer(text, add_special_tokens=False)
    mapping = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    offsets = EncodingOffsets(enc.encodings[0])
    assert len(offsets) == len(mapping)
    assert list(offsets) == mapping


SPECIAL_TEXT = "<|im_start|>user\nnaïve 🙂 text<|im_end|>\n<|im_start|>assistant\n  spaced  <|im_end|>\n"


def test_the_direct_encoding_gives_the_ids_and_offsets_of_the_tokenizer_call(tiny_tokenizer):
    ids, encoding = encode_plain(tiny_tokenizer, SPECIAL_TEXT)
    called = tiny_tokenizer(SPECIAL_TEXT, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding is not None
    assert ids == called["input_ids"]
    assert list(EncodingOffsets(encoding)) == called["offset_mapping"]
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # written special tokens stay special


@pytest.mark.parametrize("setting", ["truncation", "padding", "split_special_tokens"])
def test_a_tokenizer_set_up_otherwise_is_encoded_as_its_call_encodes(tiny_tokenizer, setting):
    tok = copy.deepcopy(tiny_tokenizer)
    if setting == "truncation":
        tok.backend_tokenizer.enable_truncation(max_length=4)
    elif setting == "padding":
        tok.backend_tokenizer.enable_padding(length=4096)
    else:
        tok.split_special_tokens = True
    ids, _ = encode_plain(tok, SPECIAL_TEXT)
    assert ids == tok(SPECIAL_TEXT, add_special_tokens=False)["input_ids"]
    plain = tiny_tokenizer(SPECIAL_TEXT, add_special_tokens=False)["input_ids"]
    if setting == "split_special_tokens":
        assert ids != plain  # the markers are spelled out byte by byte
    else:
        assert ids == plain  # the call turns truncation and padding off; so does the fallback


def test_tokenizing_in_batches_gives_each_row_what_encode_row_gives(monkeypatch, tiny_tokenizer):
    ctx = context(tiny_tokenizer, type="chat_template")
    no_answer = {"messages": [{"role": "user", "content": "Only a question."}]}
    long = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "word " * 400}]}
    rows = [ROWS[0], long, no_answer, ROWS[2], ROWS[3], no_answer, ROWS[1]]
    monkeypatch.setattr(tokenize, "ENCODE_BATCH_ROWS", 2)  # batches end inside the kept and the dropped rows
    ds = datasets.Dataset.from_list(rows)
    kept, stats = tokenize.tokenize_dataset(ds, "chat_template", ctx, 256, "drop", "test rows", None)

    formatter = chat_template.tokenize_row
    encoded = [tokenize.encode_row(row, i, formatter, ctx, 256, "drop", "test rows") for i, row in enumerate(rows)]
    expected = [e for e in encoded if not e["drop_reason"]]
    assert kept.to_list() == [{k: e[k] for k in ("input_ids", "labels", "length")} for e in expected]
    assert stats.to_dict() == {
        "rows_in": len(rows),
        "rows_kept": len(expected),
        "rows_dropped": {"longer than sequence_len": 1, "no trainable tokens": 2},
        "tokens": sum(e["length"] for e in expected),
        "trainable_tokens": sum(sum(label != IGNORE for label in e["labels"][1:]) for e in expected),
    }


def test_a_bad_row_in_a_later_batch_is_named_by_its_own_index(monkeypatch, tiny_tokenizer):
    ctx = context(tiny_tokenizer, type="chat_template")
    monkeypatch.setattr(tokenize, "ENCODE_BATCH_ROWS", 2)
    bad = {"messages": [{"role": "pilot", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    ds = datasets.Dataset.from_list([ROWS[0], ROWS[1], ROWS[0], bad])
    with pytest.raises(DataError, match="test rows, row 3: message 0 has unknown role `pilot`"):
        tokenize.tokenize_dataset(ds, "chat_template", ctx, 256, "drop", "test rows", None)
