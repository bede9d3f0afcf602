"""`tokenizer_use_mistral_common`: validation, loading a mistral-common tokenizer from a local file, and the exact ids
and labels of chat rows it encodes (assistant content and its EOS trained, everything else masked).

The tokenizer is a tiny tekken file written by the test: every byte is one token and there are no merges, so the
expected ids are written out by hand (byte b is id `N_SPECIAL + b`) independently of mistral-common.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

pytest.importorskip("mistral_common")

from mistral_common.tokens.tokenizers.base import SpecialTokens  # noqa: E402

from hellbender.config import validate_config  # noqa: E402
from hellbender.data.cache import tokenizer_fingerprint  # noqa: E402
from hellbender.data.contexts import format_context  # noqa: E402
from hellbender.data.formats import FORMATTERS, RowError  # noqa: E402
from hellbender.errors import ConfigError  # noqa: E402
from hellbender.models.loading import load_tokenizer  # noqa: E402

IGNORE = -100
SPECIALS = [t.value for t in SpecialTokens]
N_SPECIAL = len(SPECIALS)
BOS, EOS, INST, END_INST = (SPECIALS.index(t) for t in ("<s>", "</s>", "[INST]", "[/INST]"))
SYS, END_SYS = SPECIALS.index("[SYSTEM_PROMPT]"), SPECIALS.index("[/SYSTEM_PROMPT]")

CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao"},
]


def b(text: str) -> list[int]:
    return [N_SPECIAL + byte for byte in text.encode()]


def write_tekken(directory: Path, version: str = "v7") -> Path:
    """A byte-level tekken tokenizer: 256 one-byte tokens after every special token mistral-common knows."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "config": {
            "pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+",
            "num_vocab_tokens": 256,
            "default_vocab_size": 256 + N_SPECIAL,
            "default_num_special_tokens": N_SPECIAL,
            "version": version,
        },
        "vocab": [
            {"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)
        ],
        "special_tokens": [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(SPECIALS)],
        "version": 1,
        "type": "Tekken",
    }
    (directory / "tekken.json").write_text(json.dumps(data))
    return directory


def raw_config(tmp_path: Path, **overrides) -> dict:
    raw = {
        "base_model": "hellbender/tiny-llama",
        "tokenizer_config": str(write_tekken(tmp_path / "tok")),
        "tokenizer_use_mistral_common": True,
        "datasets": [{"path": "chat.jsonl", "type": "chat_template"}],
    }
    raw.update(overrides)
    return raw


def encode_row(tmp_path: Path, messages: list[dict], version: str = "v7", **entry) -> dict[str, list[int]]:
    cfg = validate_config(
        raw_config(
            tmp_path,
            tokenizer_config=str(write_tekken(tmp_path / version, version)),
            datasets=[{"path": "chat.jsonl", "type": "chat_template", **entry}],
        )
    )
    tokenizer = load_tokenizer(cfg)
    return FORMATTERS["chat_template"]({"messages": messages}, format_context(cfg.datasets[0], cfg, tokenizer))


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return str(info.value)


# --- validation ---------------------------------------------------------------------------------------------------


def test_the_key_is_accepted_and_off_by_default(tmp_path):
    assert validate_config(raw_config(tmp_path)).tokenizer_use_mistral_common is True
    raw = raw_config(tmp_path)
    del raw["tokenizer_use_mistral_common"]
    assert validate_config(raw).tokenizer_use_mistral_common is False


def test_without_mistral_common_validation_says_how_to_install_it(tmp_path, monkeypatch):
    import hellbender.config.mistral_common as check

    monkeypatch.setattr(check.util, "find_spec", lambda name: None)
    message = error_of(raw_config(tmp_path))
    assert "`tokenizer_use_mistral_common: true`" in message and "is not installed" in message
    assert "pip install 'hellbender[mistral]'" in message and "remove the key" in message


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"chat_template": "chatml"}, "`chat_template: chatml` cannot apply"),
        ({"chat_template": "jinja", "chat_template_jinja": "{{ messages }}"}, "`chat_template: jinja` cannot apply"),
        ({"tokens": ["<x>"]}, "cannot be combined with `tokens`"),
        ({"special_tokens": {"pad_token": "<pad>"}}, "cannot be combined with `special_tokens`"),
        ({"tokenizer_type": "LlamaTokenizer"}, "`tokenizer_type: LlamaTokenizer` would be ignored"),
        ({"eot_tokens": ["<end_of_turn>"]}, "`eot_tokens` cannot apply"),
        ({"processor_type": "PixtralProcessor"}, "`processor_type: PixtralProcessor` would be ignored"),
        (
            {"datasets": [{"path": "c.jsonl", "type": "chat_template", "roles_to_train": ["user", "assistant"]}]},
            "`datasets[0].roles_to_train` names `user`",
        ),
        (
            {"datasets": [{"path": "c.jsonl", "type": "chat_template", "chat_template": "chatml"}]},
            "Dataset `c.jsonl`: `chat_template: chatml` cannot apply",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused(tmp_path, changes, needle):
    assert needle in error_of(raw_config(tmp_path, **changes))
    raw = raw_config(tmp_path, **changes)
    del raw["tokenizer_use_mistral_common"]
    try:  # the same keys without mistral-common are not refused for its sake
        validate_config(raw)
    except ConfigError as exc:
        assert "mistral" not in str(exc)


# --- loading and chat rows ----------------------------------------------------------------------------------------


def test_the_tokenizer_loads_from_a_local_tekken_file(tmp_path):
    tokenizer = load_tokenizer(validate_config(raw_config(tmp_path)))
    assert type(tokenizer).__name__ == "MistralCommonBackend"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS, EOS)
    assert tokenizer.pad_token_id == SPECIALS.index("<pad>")
    # Plain text (alpaca / completion rows) gets BOS and no EOS, like any tokenizer with add_special_tokens.
    assert tokenizer("Hi", add_special_tokens=True)["input_ids"] == [BOS, *b("Hi")]


def test_assistant_turns_and_their_eos_are_trained_and_prompts_masked(tmp_path):
    row = encode_row(tmp_path, CONVERSATION)
    assert row["input_ids"] == [
        BOS, SYS, *b("Be terse."), END_SYS, INST, *b("Hi"), END_INST, *b("Hello"), EOS,
        INST, *b("Bye"), END_INST, *b("Ciao"), EOS,
    ]  # fmt: skip
    masked = lambda ids: [IGNORE] * len(ids)  # noqa: E731
    assert row["labels"] == [
        *masked([BOS, SYS, *b("Be terse."), END_SYS, INST, *b("Hi"), END_INST]), *b("Hello"), EOS,
        *masked([INST, *b("Bye"), END_INST]), *b("Ciao"), EOS,
    ]  # fmt: skip


def test_a_format_that_moves_the_system_prompt_still_finds_each_turn(tmp_path):
    # Tokenizer v3 puts the system prompt into the last user message, so the first turn is not a prefix of the
    # whole conversation; each assistant turn is still found where it is.
    row = encode_row(tmp_path, CONVERSATION, version="v3")
    ids, labels = row["input_ids"], row["labels"]
    assert ids == [
        BOS,
        INST,
        *b("Hi"),
        END_INST,
        *b("Hello"),
        EOS,
        INST,
        *b("Be terse.\n\nBye"),
        END_INST,
        *b("Ciao"),
        EOS,
    ]
    trained = [i for i, label in zip(ids, labels, strict=True) if label != IGNORE]
    assert trained == [*b("Hello"), EOS, *b("Ciao"), EOS]
    assert all(label in (IGNORE, i) for i, label in zip(ids, labels, strict=True))


@pytest.mark.parametrize(
    "train_on_eos, eos_trained",
    [("turn", [True, True]), ("last", [False, True]), ("none", [False, False]), ("all", [True, True])],
)
def test_train_on_eos_chooses_which_eos_is_trained(tmp_path, train_on_eos, eos_trained):
    row = encode_row(tmp_path, CONVERSATION, train_on_eos=train_on_eos)
    eos_positions = [i for i, t in enumerate(row["input_ids"]) if t == EOS]
    assert [row["labels"][i] == EOS for i in eos_positions] == eos_trained
    assert [t for t in row["labels"] if t not in (IGNORE, EOS)] == [*b("Hello"), *b("Ciao")]


def test_train_on_inputs_trains_every_token(tmp_path):
    row = encode_row(tmp_path, CONVERSATION, train_on_inputs=True)
    assert row["labels"] == row["input_ids"]


def test_a_conversation_ending_with_a_prompt_leaves_it_untrained(tmp_path):
    row = encode_row(tmp_path, CONVERSATION[:4])
    assert row["input_ids"][-len(b("Bye")) - 2 :] == [INST, *b("Bye"), END_INST]
    assert [t for t in row["labels"] if t != IGNORE] == [*b("Hello"), EOS]


def test_a_conversation_mistral_common_refuses_is_a_row_error(tmp_path):
    with pytest.raises(RowError, match="mistral-common refuses this conversation"):
        encode_row(tmp_path, [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}])


def test_the_cache_key_follows_the_tokenizer_file(tmp_path):
    v7 = load_tokenizer(validate_config(raw_config(tmp_path)))
    v11 = load_tokenizer(
        validate_config(raw_config(tmp_path, tokenizer_config=str(write_tekken(tmp_path / "b", "v11"))))
    )
    assert tokenizer_fingerprint(v7) == tokenizer_fingerprint(load_tokenizer(validate_config(raw_config(tmp_path))))
    assert tokenizer_fingerprint(v7) != tokenizer_fingerprint(v11)


def test_a_tiny_model_trains_on_mistral_common_rows_and_keeps_its_tokenizer_file(tmp_path):
    from tests.helpers import base_config, cli_train, trainer_state

    cfg = base_config(tmp_path, tokenizer_config=str(write_tekken(tmp_path / "tok")), tokenizer_use_mistral_common=True)
    cli_train(tmp_path, {**cfg, "max_steps": 2})
    out = Path(cfg["output_dir"])
    assert len([e for e in trainer_state(out)["log_history"] if "loss" in e]) == 2
    # The saved tokenizer is the same mistral-common file, so the output loads with `tokenizer_use_mistral_common`.
    assert (out / "tekken.json").read_bytes() == (tmp_path / "tok" / "tekken.json").read_bytes()
