"""Row formats: exact token ids and labels (which positions are -100) on small examples.

Expected values are computed here independently of the implementation: the rendered text is written out by
hand, its pieces are tokenized one by one, and each piece is marked trained or not. Where pieces are joined by
special tokens or newlines, tokenizing them apart gives the same ids as tokenizing the whole text; every test
also checks that, so the expectation cannot drift from what the model actually sees.
"""

from __future__ import annotations

import pytest

from hellbender.config import validate_config
from hellbender.data.contexts import format_context
from hellbender.data.formats import FORMATTERS, FormatContext, RowError

IGNORE = -100
EOS = "<|endoftext|>"

ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)

# A conversation with two assistant turns; no content is a substring of the ChatML markers or role names.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]


def bare_context(tokenizer, train_on_inputs: bool, text_field: str = "text") -> FormatContext:
    """A context with only what the alpaca / completion / pretokenized formats read."""
    return FormatContext(
        tokenizer=tokenizer,
        train_on_inputs=train_on_inputs,
        chat_template=None,
        field_messages=None,
        role_key=None,
        content_key=None,
        role_map=None,
        roles_to_train=(),
        train_on_eos=None,
        eot_ids=frozenset(),
        drop_system_message=False,
        text_field=text_field,
        vision=None,
    )


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def expected_from_pieces(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids of the pieces in order, and labels that keep the ids of trained pieces only."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in pieces:
        piece = ids_of(tok, text)
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    return ids, labels


def chatml_pieces(messages, train_roles=("assistant",), eos_trained=None) -> list[tuple[str, bool]]:
    """The ChatML rendering `<|im_start|>role\\ncontent<|im_end|>\\n` split into (text, trained) pieces."""
    pieces = []
    for i, m in enumerate(messages):
        trained = m["role"] in train_roles
        eos = trained if eos_trained is None else eos_trained(i, m)
        pieces += [
            (f"<|im_start|>{m['role']}\n", False),
            (m["content"], trained),
            ("<|im_end|>", eos),
            ("\n", False),
        ]
    return pieces


def chatml_text(messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def trained_text(tok, labels: list[int]) -> str:
    return tok.decode([label for label in labels if label != IGNORE])


def ctx_for(tok, entry: dict, **top) -> FormatContext:
    cfg = validate_config({"base_model": "hellbender/tiny-llama", "datasets": [entry], **top})
    return format_context(cfg.datasets[0], cfg, tok)


# --- alpaca -------------------------------------------------------------------------------------------------


def test_alpaca_masks_prompt_and_trains_output_and_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    row = {"instruction": "Name a colour.", "output": "Blue is a colour."}
    out = FORMATTERS["alpaca"](row, bare_context(tokenizer=tok, train_on_inputs=False))

    prompt = ALPACA_NO_INPUT.format(instruction="Name a colour.")
    prompt_ids = ids_of(tok, prompt)
    output_ids = ids_of(tok, "Blue is a colour.") + [tok.eos_token_id]
    assert out["input_ids"] == prompt_ids + output_ids
    assert out["labels"] == [IGNORE] * len(prompt_ids) + output_ids
    assert out["input_ids"] == ids_of(tok, prompt + "Blue is a colour." + EOS)
    assert trained_text(tok, out["labels"]) == "Blue is a colour." + EOS


def test_alpaca_with_input_uses_input_prompt_and_masks_the_input(tiny_tokenizer):
    tok = tiny_tokenizer
    row = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
    out = FORMATTERS["alpaca"](row, bare_context(tokenizer=tok, train_on_inputs=False))

    prompt = ALPACA_WITH_INPUT.format(instruction="Translate to French.", input="Good morning")
    prompt_ids = ids_of(tok, prompt)
    assert out["input_ids"] == prompt_ids + ids_of(tok, "Bonjour") + [tok.eos_token_id]
    assert out["labels"][: len(prompt_ids)] == [IGNORE] * len(prompt_ids)
    assert trained_text(tok, out["labels"]) == "Bonjour" + EOS


@pytest.mark.parametrize("empty_input", ["", None])
def test_alpaca_empty_input_uses_the_no_input_prompt(tiny_tokenizer, empty_input):
    tok = tiny_tokenizer
    row = {"instruction": "Say hi.", "input": empty_input, "output": "Hi"}
    out = FORMATTERS["alpaca"](row, bare_context(tokenizer=tok, train_on_inputs=False))
    prompt_ids = ids_of(tok, ALPACA_NO_INPUT.format(instruction="Say hi."))
    assert out["input_ids"] == prompt_ids + ids_of(tok, "Hi") + [tok.eos_token_id]


def test_alpaca_train_on_inputs_trains_every_token(tiny_tokenizer):
    tok = tiny_tokenizer
    row = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
    out = FORMATTERS["alpaca"](row, bare_context(tokenizer=tok, train_on_inputs=True))
    text = ALPACA_WITH_INPUT.format(instruction="Translate to French.", input="Good morning") + "Bonjour" + EOS
    assert out["input_ids"] == ids_of(tok, text)
    assert out["labels"] == out["input_ids"]


def test_alpaca_dataset_train_on_inputs_overrides_top_level(tiny_tokenizer):
    tok = tiny_tokenizer
    row = {"instruction": "Say hi.", "output": "Hi"}
    masked = ctx_for(tok, {"path": "x.jsonl", "type": "alpaca", "train_on_inputs": False}, train_on_inputs=True)
    trained = ctx_for(tok, {"path": "x.jsonl", "type": "alpaca"}, train_on_inputs=True)
    assert trained_text(tok, FORMATTERS["alpaca"](row, masked)["labels"]) == "Hi" + EOS
    out = FORMATTERS["alpaca"](row, trained)
    assert out["labels"] == out["input_ids"]


def test_alpaca_missing_output_column_raises_row_error(tiny_tokenizer):
    with pytest.raises(RowError, match="`output` is missing"):
        FORMATTERS["alpaca"]({"instruction": "x"}, bare_context(tokenizer=tiny_tokenizer, train_on_inputs=False))


# --- chat_template ------------------------------------------------------------------------------------------


def test_chat_template_trains_only_assistant_content_and_its_end_token(tiny_tokenizer):
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "chat_template"})
    assert ctx.roles_to_train == ("assistant",)
    out = FORMATTERS["chat_template"]({"messages": CONVERSATION}, ctx)

    ids, labels = expected_from_pieces(tok, chatml_pieces(CONVERSATION))
    assert out["input_ids"] == ids_of(tok, chatml_text(CONVERSATION)) == ids
    assert out["labels"] == labels
    assert trained_text(tok, out["labels"]) == "Four.<|im_end|>Six, of course.<|im_end|>"
    # Every trained position carries its own token id (labels are not shifted here).
    assert all(label in (IGNORE, token) for token, label in zip(out["input_ids"], out["labels"], strict=True))


def test_chat_template_roles_to_train_user_and_assistant(tiny_tokenizer):
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "chat_template", "roles_to_train": ["user", "assistant"]})
    out = FORMATTERS["chat_template"]({"messages": CONVERSATION}, ctx)
    ids, labels = expected_from_pieces(tok, chatml_pieces(CONVERSATION, train_roles=("user", "assistant")))
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert trained_text(tok, out["labels"]) == (
        "What is two plus two?<|im_end|>Four.<|im_end|>And three plus three?<|im_end|>Six, of course.<|im_end|>"
    )


@pytest.mark.parametrize(
    ("mode", "eos_trained", "expected_text"),
    [
        ("turn", lambda i, m: m["role"] == "assistant", "Four.<|im_end|>Six, of course.<|im_end|>"),
        ("all", lambda i, m: True, "<|im_end|><|im_end|>Four.<|im_end|><|im_end|>Six, of course.<|im_end|>"),
        ("last", lambda i, m: i == 4, "Four.Six, of course.<|im_end|>"),
        ("none", lambda i, m: False, "Four.Six, of course."),
    ],
)
def test_chat_template_train_on_eos(tiny_tokenizer, mode, eos_trained, expected_text):
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "chat_template", "train_on_eos": mode})
    out = FORMATTERS["chat_template"]({"messages": CONVERSATION}, ctx)
    ids, labels = expected_from_pieces(tok, chatml_pieces(CONVERSATION, eos_trained=eos_trained))
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert trained_text(tok, out["labels"]) == expected_text


def test_chat_template_train_on_inputs_trains_everything(tiny_tokenizer):
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "chat_template"}, train_on_inputs=True)
    out = FORMATTERS["chat_template"]({"messages": CONVERSATION}, ctx)
    assert out["input_ids"] == ids_of(tok, chatml_text(CONVERSATION))
    assert out["labels"] == out["input_ids"]


def test_sharegpt_conversations_with_role_mapping(tiny_tokenizer):
    tok = tiny_tokenizer
    entry = {
        "path": "x.jsonl",
        "type": "chat_template",
        "roles": {"user": ["human", "customer"], "assistant": ["gpt", "agent"]},
    }
    ctx = ctx_for(tok, entry)
    row = {
        "conversations": [
            {"from": "customer", "value": "Where is my parcel?"},
            {"from": "agent", "value": "It ships today."},
            {"from": "human", "value": "Thanks!"},
            {"from": "gpt", "value": "You are welcome."},
        ]
    }
    out = FORMATTERS["chat_template"](row, ctx)
    rendered = [
        {"role": "user", "content": "Where is my parcel?"},
        {"role": "assistant", "content": "It ships today."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ]
    ids, labels = expected_from_pieces(tok, chatml_pieces(rendered))
    assert out["input_ids"] == ids_of(tok, chatml_text(rendered)) == ids
    assert out["labels"] == labels
    assert trained_text(tok, out["labels"]) == "It ships today.<|im_end|>You are welcome.<|im_end|>"


def test_field_messages_and_message_property_mappings(tiny_tokenizer):
    tok = tiny_tokenizer
    entry = {
        "path": "x.jsonl",
        "type": "chat_template",
        "field_messages": "dialog",
        "message_property_mappings": {"role": "speaker", "content": "text"},
    }
    ctx = ctx_for(tok, entry)
    row = {
        "dialog": [
            {"speaker": "user", "text": "Capital of France?"},
            {"speaker": "assistant", "text": "Paris."},
        ],
        # A `messages` column that must be ignored: field_messages points elsewhere.
        "messages": [{"speaker": "user", "text": "ignored"}],
    }
    out = FORMATTERS["chat_template"](row, ctx)
    rendered = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    ids, labels = expected_from_pieces(tok, chatml_pieces(rendered))
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert trained_text(tok, out["labels"]) == "Paris.<|im_end|>"


def test_unknown_role_raises_row_error_naming_the_role(tiny_tokenizer):
    ctx = ctx_for(tiny_tokenizer, {"path": "x.jsonl", "type": "chat_template"})
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep"}]}
    with pytest.raises(RowError, match=r"message 1 has unknown role `robot`") as exc:
        FORMATTERS["chat_template"](row, ctx)
    assert "roles:" in str(exc.value)  # the fix is named


def test_unknown_role_with_custom_roles_mapping_still_raises(tiny_tokenizer):
    ctx = ctx_for(tiny_tokenizer, {"path": "x.jsonl", "type": "chat_template", "roles": {"assistant": ["agent"]}})
    row = {"conversations": [{"from": "customer", "value": "Hi"}, {"from": "agent", "value": "Hello"}]}
    with pytest.raises(RowError, match="unknown role `customer`"):
        FORMATTERS["chat_template"](row, ctx)


def test_missing_messages_column_raises_row_error(tiny_tokenizer):
    ctx = ctx_for(tiny_tokenizer, {"path": "x.jsonl", "type": "chat_template"})
    with pytest.raises(RowError, match="`conversations` .* is missing"):
        FORMATTERS["chat_template"]({"text": "hello"}, ctx)


@pytest.mark.parametrize(
    "answer",
    [
        "end",  # also occurs inside the user turn's `<|im_end|>` marker
        "a",  # also occurs inside `<|im_start|>` and the `assistant` header
        "assistant",  # the role name in the header
    ],
)
def test_chat_template_short_answer_that_occurs_in_the_markup_is_trained(tiny_tokenizer, answer):
    """Contents are located by searching the rendered text; an answer that also appears in the template's
    own markup (a marker or role name) between the previous content and itself must still be the tokens trained."""
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "chat_template"})
    messages = [{"role": "user", "content": "Reply with one word."}, {"role": "assistant", "content": answer}]
    out = FORMATTERS["chat_template"]({"messages": messages}, ctx)
    ids, labels = expected_from_pieces(tok, chatml_pieces(messages))
    assert out["input_ids"] == ids
    assert trained_text(tok, out["labels"]) == answer + "<|im_end|>"
    assert out["labels"] == labels


def test_chat_template_empty_assistant_turn_trains_its_own_end_token(tiny_tokenizer):
    """An empty assistant reply trains only its own `<|im_end|>`, never the user turn's."""
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "chat_template"})
    messages = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    out = FORMATTERS["chat_template"]({"messages": messages}, ctx)
    ids, labels = expected_from_pieces(tok, chatml_pieces(messages))
    assert out["input_ids"] == ids
    assert out["labels"] == labels


# --- completion ---------------------------------------------------------------------------------------------


def test_completion_trains_all_tokens_and_appends_eos_once(tiny_tokenizer):
    tok = tiny_tokenizer
    out = FORMATTERS["completion"]({"text": "The quick brown fox."}, bare_context(tokenizer=tok, train_on_inputs=False))
    assert out["input_ids"] == ids_of(tok, "The quick brown fox.") + [tok.eos_token_id]
    assert out["labels"] == out["input_ids"]
    assert out["input_ids"].count(tok.eos_token_id) == 1


def test_completion_reads_the_configured_field(tiny_tokenizer):
    tok = tiny_tokenizer
    ctx = ctx_for(tok, {"path": "x.jsonl", "type": "completion", "field": "body"})
    out = FORMATTERS["completion"]({"body": "Some text", "text": "other"}, ctx)
    assert out["input_ids"] == ids_of(tok, "Some text") + [tok.eos_token_id]
    with pytest.raises(RowError, match="`body` is missing"):
        FORMATTERS["completion"]({"text": "other"}, ctx)


def test_completion_empty_text_gives_an_empty_row(tiny_tokenizer):
    out = FORMATTERS["completion"]({"text": ""}, bare_context(tokenizer=tiny_tokenizer, train_on_inputs=False))
    assert out == {"input_ids": [], "labels": []}


# --- pretokenized -------------------------------------------------------------------------------------------


def pretok(row, tok):
    return FORMATTERS["pretokenized"](row, bare_context(tokenizer=tok, train_on_inputs=False))


def test_pretokenized_labels_default_to_input_ids(tiny_tokenizer):
    assert pretok({"input_ids": [5, 6, 7]}, tiny_tokenizer) == {"input_ids": [5, 6, 7], "labels": [5, 6, 7]}
    assert pretok({"input_ids": [5, 6], "labels": None}, tiny_tokenizer) == {"input_ids": [5, 6], "labels": [5, 6]}


def test_pretokenized_strips_attention_mask_zeros_and_keeps_labels_aligned(tiny_tokenizer):
    row = {
        "input_ids": [1, 1, 5, 6, 7, 1],
        "attention_mask": [0, 0, 1, 1, 1, 0],
        "labels": [-100, -100, -100, 6, 7, -100],
    }
    assert pretok(row, tiny_tokenizer) == {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}


def test_pretokenized_negative_labels_become_ignore_index(tiny_tokenizer):
    out = pretok({"input_ids": [5, 6, 7], "labels": [-1, 6, -100]}, tiny_tokenizer)
    assert out["labels"] == [-100, 6, -100]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"input_ids": [5, 6, 7], "labels": [5, 6]}, "`labels` has 2 entries but `input_ids` has 3"),
        ({"input_ids": [5, 6, 7], "attention_mask": [1, 1]}, "`attention_mask` has 2 entries but `input_ids` has 3"),
        ({"input_ids": [5, 100000]}, "outside the tokenizer's vocabulary"),
        ({"input_ids": [5, -1]}, "outside the tokenizer's vocabulary"),
        ({"input_ids": "5 6 7"}, "`input_ids` must be a list of integers"),
        ({"tokens": [5, 6]}, "`input_ids` is missing"),
    ],
)
def test_pretokenized_bad_rows_raise_row_error(tiny_tokenizer, row, message):
    with pytest.raises(RowError, match=message):
        pretok(row, tiny_tokenizer)


# --- eot_tokens ---------------------------------------------------------------------------------------------

# A template that writes a marker special token (<|pad|>) before the real end of turn (<|im_end|>).
MARKED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|pad|><|im_end|>\\n' }}{% endfor %}"
)


def test_eot_tokens_that_name_the_templates_marker_change_nothing(tiny_tokenizer):
    entry = {"path": "x.jsonl", "type": "chat_template"}
    plain = FORMATTERS["chat_template"]({"messages": CONVERSATION}, ctx_for(tiny_tokenizer, entry))
    named = FORMATTERS["chat_template"](
        {"messages": CONVERSATION}, ctx_for(tiny_tokenizer, entry, eot_tokens=["<|im_end|>"])
    )
    assert named == plain


def test_eot_tokens_pick_the_end_of_turn_past_other_special_tokens(tiny_tokenizer):
    entry = {
        "path": "x.jsonl",
        "type": "chat_template",
        "chat_template": "jinja",
        "chat_template_jinja": MARKED_TEMPLATE,
    }
    first_special = FORMATTERS["chat_template"]({"messages": CONVERSATION}, ctx_for(tiny_tokenizer, entry))
    assert trained_text(tiny_tokenizer, first_special["labels"]) == "Four.<|pad|>Six, of course.<|pad|>"
    named = FORMATTERS["chat_template"](
        {"messages": CONVERSATION}, ctx_for(tiny_tokenizer, entry, eot_tokens=["<|im_end|>"])
    )
    assert trained_text(tiny_tokenizer, named["labels"]) == "Four.<|im_end|>Six, of course.<|im_end|>"


def test_an_eot_token_the_tokenizer_splits_is_refused(tiny_tokenizer):
    from hellbender.errors import DataError

    with pytest.raises(DataError, match=r"`eot_tokens` names `<end_of_turn>`, which this tokenizer splits into"):
        ctx_for(tiny_tokenizer, {"path": "x.jsonl", "type": "chat_template"}, eot_tokens=["<end_of_turn>"])
