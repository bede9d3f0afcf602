"""Preparing datasets end to end, and the prepared-dataset cache (keys, reuse, atomic writes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import hellbender.data.prepare as prepare_mod
from hellbender.config import validate_config
from hellbender.data import cache
from hellbender.data.prepare import prepare_datasets
from hellbender.errors import DataError
from tests.conftest import write_jsonl

IGNORE = -100

OTHER_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ': ' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
)


def chat_rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Question number {i}?"},
                {"role": "assistant", "content": f"Answer number {i}."},
            ]
        }
        for i in range(n)
    ]


def make_cfg(tmp_path: Path, data: Path, entry: dict | None = None, **top):
    raw = {
        "base_model": "hellbender/tiny-llama",
        "datasets": [{"path": str(data), "type": "chat_template", **(entry or {})}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "sequence_len": 128,
        **top,
    }
    return validate_config(raw)


@pytest.fixture
def count_tokenize(monkeypatch):
    calls = []
    real = prepare_mod.tokenize_dataset

    def counting(*args, **kwargs):
        calls.append(args[3] if len(args) > 3 else kwargs.get("max_len"))
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_mod, "tokenize_dataset", counting)
    return calls


def rows_of(ds) -> list[tuple]:
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in ds)


# --- the cache ----------------------------------------------------------------------------------------------


def test_second_call_reuses_the_cache_without_tokenizing(tmp_path, tiny_tokenizer, count_tokenize):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = make_cfg(tmp_path, data)
    first = prepare_datasets(cfg, tiny_tokenizer)
    assert first.from_cache is False
    assert len(count_tokenize) == 1
    assert cache.cached_dir(cfg.dataset_prepared_path, first.cache_dir.name) == first.cache_dir

    second = prepare_datasets(cfg, tiny_tokenizer)
    assert second.from_cache is True
    assert len(count_tokenize) == 1  # not tokenized again
    assert second.cache_dir == first.cache_dir
    assert second.stats == first.stats
    assert [dict(r) for r in second.train] == [dict(r) for r in first.train]
    assert len(second.train) == 6


def test_changed_chat_template_gets_its_own_cache(tmp_path, tiny_tokenizer, count_tokenize):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = make_cfg(tmp_path, data)
    first = prepare_datasets(cfg, tiny_tokenizer)

    other = copy.deepcopy(tiny_tokenizer)
    other.chat_template = OTHER_TEMPLATE
    second = prepare_datasets(cfg, other)
    assert second.from_cache is False
    assert second.cache_dir != first.cache_dir
    assert len(count_tokenize) == 2
    assert rows_of(second.train) != rows_of(first.train)
    # The original tokenizer still finds its own cache.
    assert prepare_datasets(cfg, tiny_tokenizer).cache_dir == first.cache_dir
    assert len(count_tokenize) == 2


def test_changed_text_of_a_named_template_gets_its_own_cache(tmp_path, tiny_tokenizer, count_tokenize, monkeypatch):
    """A dataset's named template is not stored on the tokenizer, so its text (which a release may change) must
    key the cache itself."""
    from dataclasses import replace

    from hellbender.chat_templates import NAMED_TEMPLATES

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = make_cfg(tmp_path, data, {"chat_template": "chatml"})
    first = prepare_datasets(cfg, tiny_tokenizer)
    monkeypatch.setitem(NAMED_TEMPLATES, "chatml", replace(NAMED_TEMPLATES["chatml"], jinja=OTHER_TEMPLATE))
    second = prepare_datasets(cfg, tiny_tokenizer)
    assert second.from_cache is False
    assert second.cache_dir != first.cache_dir
    assert rows_of(second.train) != rows_of(first.train)


def test_changed_dataset_key_gets_its_own_cache(tmp_path, tiny_tokenizer, count_tokenize):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    first = prepare_datasets(make_cfg(tmp_path, data), tiny_tokenizer)
    second = prepare_datasets(make_cfg(tmp_path, data, {"roles_to_train": ["user", "assistant"]}), tiny_tokenizer)
    assert second.from_cache is False
    assert second.cache_dir != first.cache_dir
    assert len(count_tokenize) == 2
    assert second.stats["train"]["trainable_tokens"] > first.stats["train"]["trainable_tokens"]


def test_changed_setting_gets_its_own_cache(tmp_path, tiny_tokenizer, count_tokenize):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    first = prepare_datasets(make_cfg(tmp_path, data), tiny_tokenizer)
    second = prepare_datasets(make_cfg(tmp_path, data, sequence_len=64), tiny_tokenizer)
    assert second.from_cache is False
    assert second.cache_dir != first.cache_dir
    assert count_tokenize == [128, 64]


def test_edited_data_file_gets_its_own_cache(tmp_path, tiny_tokenizer, count_tokenize):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = make_cfg(tmp_path, data)
    first = prepare_datasets(cfg, tiny_tokenizer)
    write_jsonl(data, chat_rows(5))
    second = prepare_datasets(cfg, tiny_tokenizer)
    assert second.from_cache is False
    assert second.cache_dir != first.cache_dir
    assert len(second.train) == 5
    assert len(count_tokenize) == 2


def test_killed_write_leaves_no_complete_directory_and_no_staging(tmp_path):
    root = tmp_path / "prepared"

    def write(staging: Path) -> dict:
        (staging / "train").mkdir()
        (staging / "train" / "part.arrow").write_bytes(b"half a file")
        raise KeyboardInterrupt  # a Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        cache.write_entry(root, "abc", write)
    assert cache.cached_dir(root, "abc") is None
    assert not (root / "abc").exists()
    assert list(root.iterdir()) == []  # the staging directory is gone too

    final = cache.write_entry(root, "abc", lambda staging: {"stats": {"rows": 1}})
    assert cache.cached_dir(root, "abc") == final == root / "abc"
    marker = json.loads((final / cache.COMPLETE_MARKER).read_text())
    assert marker == {"key": "abc", "stats": {"rows": 1}}
    assert [p.name for p in root.iterdir()] == ["abc"]


def test_prepare_failure_midway_leaves_nothing_behind(tmp_path, tiny_tokenizer, monkeypatch):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = make_cfg(tmp_path, data, sample_packing=True)

    def broken_pack(*args, **kwargs):
        raise RuntimeError("killed while packing")

    monkeypatch.setattr(prepare_mod, "pack_dataset", broken_pack)
    with pytest.raises(RuntimeError, match="killed while packing"):
        prepare_datasets(cfg, tiny_tokenizer)
    assert list(Path(cfg.dataset_prepared_path).iterdir()) == []


def test_incomplete_directory_under_the_key_is_not_reused(tmp_path):
    """A directory with the key's name but no completion marker (e.g. a half-finished `rm -r` of an old cache)
    must not be returned as the finished cache."""
    root = tmp_path / "prepared"
    (root / "abc" / "train").mkdir(parents=True)
    assert cache.cached_dir(root, "abc") is None

    final = cache.write_entry(root, "abc", lambda staging: {"stats": {}})
    assert cache.cached_dir(root, "abc") == final


# --- preparing ----------------------------------------------------------------------------------------------


def test_prepared_rows_hold_the_formatted_tokens(tmp_path, tiny_tokenizer):
    rows = chat_rows(3)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    prepared = prepare_datasets(make_cfg(tmp_path, data), tiny_tokenizer)
    assert prepared.eval is None
    assert prepared.stats["train"]["rows_in"] == 3
    assert prepared.stats["train"]["rows_kept"] == 3
    decoded = sorted(tiny_tokenizer.decode(r["input_ids"]) for r in prepared.train)
    expected = sorted(
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"]) for r in rows
    )
    assert decoded == expected
    for r in prepared.train:
        trained = tiny_tokenizer.decode([x for x in r["labels"] if x != IGNORE])
        assert trained.startswith("Answer number ")
        assert trained.endswith(".<|im_end|>")
        assert r["length"] == len(r["input_ids"])


@pytest.mark.parametrize(("val_set_size", "n_eval"), [(0.25, 3), (3, 3), (1, 1)])
def test_val_set_size_splits_the_rows(tmp_path, tiny_tokenizer, val_set_size, n_eval):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    cfg = make_cfg(tmp_path, data, val_set_size=val_set_size)
    prepared = prepare_datasets(cfg, tiny_tokenizer)
    assert len(prepared.eval) == n_eval
    assert len(prepared.train) == 12 - n_eval
    assert prepared.stats["train_rows"] == 12 - n_eval
    assert prepared.stats["eval_rows"] == n_eval
    # Train and eval together are exactly the input rows, none in both.
    everything = rows_of(prepare_datasets(make_cfg(tmp_path / "all", data), tiny_tokenizer).train)
    assert sorted(rows_of(prepared.train) + rows_of(prepared.eval)) == everything
    # Reloaded from the cache, the split is the same.
    again = prepare_datasets(cfg, tiny_tokenizer)
    assert again.from_cache is True
    assert rows_of(again.eval) == rows_of(prepared.eval)


def test_val_set_size_that_leaves_no_training_rows_raises(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    with pytest.raises(DataError, match="`val_set_size: 3.0` leaves no training rows out of 3"):
        prepare_datasets(make_cfg(tmp_path, data, val_set_size=3), tiny_tokenizer)


def test_sample_packing_produces_packed_rows_with_seq_lens(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    unpacked = prepare_datasets(make_cfg(tmp_path / "a", data), tiny_tokenizer).train
    cfg = make_cfg(tmp_path / "b", data, sample_packing=True, sequence_len=128)
    prepared = prepare_datasets(cfg, tiny_tokenizer)
    packed = prepared.train
    assert "seq_lens" in packed.column_names
    lengths = {len(r["input_ids"]) for r in unpacked}
    assert len(lengths) == 1  # equal rows: exactly 128 // length of them share a bin
    per_bin = 128 // lengths.pop()
    assert 1 < per_bin < 10
    assert len(packed) == -(-10 // per_bin)
    assert prepared.stats["packed_bins"] == len(packed)
    assert prepared.stats["train_rows"] == 10
    docs = {tuple(r["input_ids"]): r["labels"] for r in unpacked}
    seen = []
    for row in packed:
        assert len(row["input_ids"]) == len(row["labels"]) == sum(row["seq_lens"]) <= 128
        start = 0
        for n in row["seq_lens"]:
            ids = tuple(row["input_ids"][start : start + n])
            labels = row["labels"][start : start + n]
            assert ids in docs  # every block is exactly one prepared document
            assert labels == [IGNORE] + docs[ids][1:]
            seen.append(ids)
            start += n
    assert sorted(seen) == sorted(docs)  # every document exactly once


def test_over_long_row_is_dropped_and_counted(tmp_path, tiny_tokenizer):
    rows = chat_rows(3)
    rows[1]["messages"][1]["content"] = "word " * 100
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    prepared = prepare_datasets(make_cfg(tmp_path, data, sequence_len=64), tiny_tokenizer)
    assert prepared.stats["train"]["rows_in"] == 3
    assert prepared.stats["train"]["rows_kept"] == 2
    assert prepared.stats["train"]["rows_dropped"] == {"longer than sequence_len": 1}
    assert len(prepared.train) == 2
    assert all(len(r["input_ids"]) <= 64 for r in prepared.train)


def test_over_long_row_is_truncated(tmp_path, tiny_tokenizer):
    rows = chat_rows(3)
    rows[1]["messages"][1]["content"] = "word " * 100
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = make_cfg(tmp_path, data, sequence_len=64, excess_length_strategy="truncate")
    prepared = prepare_datasets(cfg, tiny_tokenizer)
    assert prepared.stats["train"]["rows_kept"] == 3
    assert prepared.stats["train"]["rows_dropped"] == {}
    lengths = sorted(len(r["input_ids"]) for r in prepared.train)
    assert lengths[-1] == 64
    long_row = next(r for r in prepared.train if len(r["input_ids"]) == 64)
    full = tiny_tokenizer.apply_chat_template(rows[1]["messages"], tokenize=False)
    assert long_row["input_ids"] == tiny_tokenizer(full, add_special_tokens=False)["input_ids"][:64]
    assert long_row["length"] == 64


def test_over_long_row_raises_naming_the_row(tmp_path, tiny_tokenizer):
    rows = chat_rows(3)
    rows[2]["messages"][1]["content"] = "word " * 100
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = make_cfg(tmp_path, data, sequence_len=64, excess_length_strategy="raise")
    with pytest.raises(DataError, match=r"row 2: \d+ tokens, more than `sequence_len: 64`") as exc:
        prepare_datasets(cfg, tiny_tokenizer)
    assert str(data) in str(exc.value)
    assert list(Path(cfg.dataset_prepared_path).iterdir()) == []


def test_bad_row_raises_naming_the_row(tmp_path, tiny_tokenizer):
    rows = chat_rows(4)
    rows[3]["messages"][0]["role"] = "narrator"
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match=r"row 3: message 0 has unknown role `narrator`") as exc:
        prepare_datasets(make_cfg(tmp_path, data), tiny_tokenizer)
    assert str(data) in str(exc.value)


def test_every_row_dropped_raises(tmp_path, tiny_tokenizer):
    rows = chat_rows(2)
    for r in rows:
        r["messages"][1]["content"] = "word " * 100
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match="Every training row was dropped .*2 longer than sequence_len"):
        prepare_datasets(make_cfg(tmp_path, data, sequence_len=64), tiny_tokenizer)


def test_empty_dataset_file_raises_data_error(tmp_path, tiny_tokenizer):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        prepare_datasets(make_cfg(tmp_path, data), tiny_tokenizer)


def test_dataset_file_of_blank_lines_raises_data_error(tmp_path, tiny_tokenizer):
    data = tmp_path / "blank.jsonl"
    data.write_text("\n\n")
    with pytest.raises(DataError, match="blank.jsonl"):
        prepare_datasets(make_cfg(tmp_path, data), tiny_tokenizer)


def test_mixed_datasets_and_test_datasets(tmp_path, tiny_tokenizer):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    alpaca = write_jsonl(
        tmp_path / "alpaca.jsonl",
        [{"instruction": f"Say {w}.", "output": w} for w in ["yes", "no"]],
    )
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"text": "held out text"}])
    cfg = validate_config(
        {
            "base_model": "hellbender/tiny-llama",
            "datasets": [{"path": str(chat), "type": "chat_template"}, {"path": str(alpaca), "type": "alpaca"}],
            "test_datasets": [{"path": str(evaluation), "type": "completion"}],
            "dataset_prepared_path": str(tmp_path / "prepared"),
            "sequence_len": 128,
        }
    )
    prepared = prepare_datasets(cfg, tiny_tokenizer)
    assert len(prepared.train) == 5
    assert prepared.stats["train"]["rows_in"] == 5
    assert [tiny_tokenizer.decode(r["input_ids"]) for r in prepared.eval] == ["held out text<|endoftext|>"]
    assert prepared.stats["eval"]["rows_kept"] == 1


def test_pretraining_dataset_without_streaming_is_prepared_as_completion(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "corpus.jsonl", [{"body": "First document."}, {"body": "Second one."}])
    cfg = validate_config(
        {
            "base_model": "hellbender/tiny-llama",
            "pretraining_dataset": [{"path": str(data), "text_column": "body"}],
            "streaming": False,
            "dataset_prepared_path": str(tmp_path / "prepared"),
            "sequence_len": 64,
        }
    )
    prepared = prepare_datasets(cfg, tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    expected = sorted(
        tiny_tokenizer(text, add_special_tokens=True)["input_ids"] + [eos]
        for text in ["First document.", "Second one."]
    )
    assert sorted(r["input_ids"] for r in prepared.train) == expected
    assert all(r["labels"] == r["input_ids"] for r in prepared.train)
    # Editing the corpus invalidates the cache like any dataset file.
    write_jsonl(data, [{"body": "Changed."}])
    again = prepare_datasets(cfg, tiny_tokenizer)
    assert again.from_cache is False
    assert [tiny_tokenizer.decode(r["input_ids"]) for r in again.train] == ["Changed.<|endoftext|>"]
