"""Streamed training data: supervised rows (`streaming: true` over `datasets:`) get the labels of prepared rows;
`streaming_multipack_buffer_size` sizes the shuffle and packing buffers; `pretrain_multipack_attn`; streams cycle
until `max_steps`, and a resumed run reproduces the uninterrupted one across passes over the data."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hellbender.config import validate_config
from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.prepare import prepare_datasets
from hellbender.data.streaming import streaming_dataset
from hellbender.data.streaming_sft import in_turn
from hellbender.errors import DataError
from hellbender.train.run import train
from tests.conftest import EXAMPLES, write_jsonl
from tests.helpers import CHAT_DATA, StopAt, base_config, final_weights, logged_losses, trainer_state

ALPACA_DATA = str(EXAMPLES / "data" / "alpaca.jsonl")
DATASETS = {
    "alpaca": {"path": ALPACA_DATA, "type": "alpaca"},
    "chat_template": {"path": CHAT_DATA, "type": "chat_template"},
}


def streamed_sft(tmp_path: Path, **overrides) -> dict:
    """Streamed chat rows (22 to 54 tokens each; the alpaca rows are 160 to 169)."""
    defaults = dict(datasets=[DATASETS["chat_template"]], streaming=True, max_steps=4, sequence_len=128)
    return base_config(tmp_path, **{**defaults, **overrides})


def documents(packed_row: dict) -> list[tuple[list[int], list[int]]]:
    """The (input_ids, labels) of each document of a packed row, cut at its `seq_lens`."""
    out, start = [], 0
    for n in packed_row["seq_lens"]:
        out.append((packed_row["input_ids"][start : start + n], packed_row["labels"][start : start + n]))
        start += n
    return out


@pytest.mark.parametrize(("name", "sequence_len"), [("alpaca", 163), ("chat_template", 30)])
def test_streamed_rows_carry_the_labels_of_the_prepared_rows(tmp_path, tiny_tokenizer, name, sequence_len):
    """In file order (no shuffle, no packing) the stream yields exactly the prepared rows, row by row: the same
    prompt formatting, the same masking, the same rows dropped for length."""
    # This sequence_len drops some rows for length: they must be dropped from the stream too.
    common = dict(datasets=[DATASETS[name]], sequence_len=sequence_len, shuffle_merged_datasets=False)
    prepared = prepare_datasets(validate_config(base_config(tmp_path / "prepared", **common)), tiny_tokenizer)
    stream = streaming_dataset(validate_config(streamed_sft(tmp_path / "streamed", **common)), tiny_tokenizer)
    expected = [(row["input_ids"], row["labels"]) for row in prepared.train]
    assert 0 < len(expected) < prepared.stats["train"]["rows_in"]  # some rows were dropped for length
    streamed = [(row["input_ids"], row["labels"]) for row in stream.rows_of_pass(0)]
    assert streamed == expected
    assert any(IGNORE_INDEX in labels for _, labels in streamed)  # prompts are masked, not trained


def test_packed_stream_holds_each_prepared_row_once_with_its_labels(tmp_path, tiny_tokenizer):
    cfg = validate_config(streamed_sft(tmp_path, sample_packing=True, shuffle_merged_datasets=False))
    prepared = prepare_datasets(
        validate_config(base_config(tmp_path / "prepared", datasets=[DATASETS["chat_template"]], sequence_len=128)),
        tiny_tokenizer,
    )
    labels_of = {tuple(r["input_ids"]): r["labels"] for r in prepared.train}
    stream = iter(streaming_dataset(cfg, tiny_tokenizer))
    packed = []
    while sum(len(p["seq_lens"]) for p in packed) < len(prepared.train):  # one pass over the data
        packed.append(next(stream))
    assert all(len(p["input_ids"]) <= cfg.sequence_len for p in packed)
    docs = [doc for p in packed for doc in documents(p)]
    assert sorted(ids for ids, _ in docs) == sorted(prepared.train["input_ids"])
    for ids, labels in docs:  # a packed document is masked like its row, its first label (never a target) aside
        assert labels == [IGNORE_INDEX] + labels_of[tuple(ids)][1:]
    assert len(packed) < len(prepared.train) / 2  # several rows share each bin


def unique_chat_rows(tmp_path: Path, n: int = 60) -> dict:
    """A chat dataset entry of `n` distinct rows of different lengths (a row is known by its tokens)."""
    rows = [
        {"messages": [{"role": "user", "content": f"Row {i}?"}, {"role": "assistant", "content": "ok " * (i % 11)}]}
        for i in range(n)
    ]
    return {"path": str(write_jsonl(tmp_path / "unique.jsonl", rows)), "type": "chat_template"}


def test_the_buffer_size_bounds_which_rows_are_packed_together(tmp_path, tiny_tokenizer):
    """Rows are packed `streaming_multipack_buffer_size` at a time: with a buffer of 4 each bin holds rows of one
    group of 4 consecutive rows, and the bins fill worse than with a buffer of the whole data."""
    entry = unique_chat_rows(tmp_path)

    def stream(buffer: int, **keys):
        cfg = streamed_sft(
            tmp_path / str(buffer),
            datasets=[entry],
            shuffle_merged_datasets=False,
            streaming_multipack_buffer_size=buffer,
        )
        return streaming_dataset(validate_config({**cfg, **keys}), tiny_tokenizer)

    order = [tuple(row["input_ids"]) for row in stream(10_000).rows_of_pass(0)]
    position = {ids: i for i, ids in enumerate(order)}
    assert len(position) == 60

    def one_pass(buffer: int) -> list[dict]:
        bins, rows = [], iter(stream(buffer, sample_packing=True))
        while sum(len(b["seq_lens"]) for b in bins) < 60:
            bins.append(next(rows))
        return bins

    small, large = one_pass(4), one_pass(10_000)
    groups = [{position[tuple(ids)] // 4 for ids, _ in documents(b)} for b in small]
    assert all(len(g) == 1 for g in groups)
    assert sorted(g.pop() for g in groups)[-1] == 14  # every group of the pass, in bins of its own
    assert len(large) < len(small)
    assert any(len({position[tuple(ids)] // 4 for ids, _ in documents(b)}) > 1 for b in large)


def test_the_buffer_size_is_the_shuffle_buffer(tmp_path, tiny_tokenizer):
    entry = unique_chat_rows(tmp_path)

    def first_rows(buffer: int, shuffle: bool = True) -> list[int]:
        cfg = streamed_sft(
            tmp_path / f"{buffer}{shuffle}",
            datasets=[entry],
            shuffle_merged_datasets=shuffle,
            streaming_multipack_buffer_size=buffer,
        )
        return [tuple(r["input_ids"]) for r in streaming_dataset(validate_config(cfg), tiny_tokenizer).rows_of_pass(0)]

    in_order = first_rows(10_000, shuffle=False)
    index = {ids: i for i, ids in enumerate(in_order)}
    small, large = [[index[ids] for ids in first_rows(n)] for n in (2, 10_000)]
    assert sorted(small) == sorted(large) == list(range(60))  # one pass: every row once
    # The row read at step k leaves a buffer of 2 at step k or later: the first 20 rows served are among the first 21.
    assert small != list(range(60)) and max(small[:20]) <= 20
    assert max(large[:20]) > 30


def test_the_older_buffer_key_is_read_with_a_notice(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hellbender"):
        cfg = validate_config(streamed_sft(tmp_path, pretrain_multipack_buffer_size=64))
    assert cfg.streaming_multipack_buffer_size == 64
    assert "`pretrain_multipack_buffer_size` is an older spelling of `streaming_multipack_buffer_size`" in caplog.text


def test_entries_are_mixed_in_turn():
    assert list(in_turn([iter("abc"), iter("x"), iter("12")])) == list("ax1b2c")


def test_a_stream_whose_every_row_is_dropped_says_why(tmp_path, tiny_tokenizer):
    stream = streaming_dataset(validate_config(streamed_sft(tmp_path, sequence_len=8)), tiny_tokenizer)
    with pytest.raises(DataError, match=r"Every streamed training row was dropped \(400 longer than sequence_len\)"):
        next(iter(stream))


def test_rows_without_input_ids_and_no_type_fail_before_training(tmp_path, tiny_tokenizer):
    cfg = validate_config(streamed_sft(tmp_path, datasets=[{"path": ALPACA_DATA}]))
    with pytest.raises(DataError, match=r"datasets\[0\].*has no `type` \(so `pretokenized`\)"):
        streaming_dataset(cfg, tiny_tokenizer)


def test_streamed_sft_trains_for_max_steps_on_packed_rows(tmp_path):
    held_out = unique_chat_rows(tmp_path, n=4)
    cfg = validate_config(
        streamed_sft(tmp_path, sample_packing=True, micro_batch_size=2, max_steps=4, test_datasets=[held_out])
    )
    assert cfg.uses_streaming and cfg.streams_datasets
    metrics = train(cfg)
    assert sorted(logged_losses(cfg.output_dir)) == [1, 2, 3, 4]
    evals = [e for e in trainer_state(cfg.output_dir)["log_history"] if "eval_loss" in e]
    assert evals and 0 < evals[-1]["eval_loss"] < 10  # the test rows are prepared and evaluated as usual
    # Packed chat rows: most of each bin is real tokens, and the prompts are not trained.
    assert metrics["input_tokens"] > 0.8 * 4 * 2 * 128
    assert 0 < metrics["trained_tokens"] < 0.6 * metrics["input_tokens"]


def streamed_text(tmp_path: Path, n: int = 10, **overrides) -> dict:
    rows = [{"text": f"Document {i}: " + "words " * (i % 7)} for i in range(n)]
    entry = {"path": str(write_jsonl(tmp_path / "text.jsonl", rows))}
    return base_config(tmp_path, datasets=[], pretraining_dataset=[entry], sequence_len=32, **overrides)


def test_streamed_pretraining_text_cycles_with_a_new_shuffle_each_pass(tmp_path, tiny_tokenizer):
    cfg = validate_config(streamed_text(tmp_path, max_steps=2, streaming_multipack_buffer_size=4))
    stream = streaming_dataset(cfg, tiny_tokenizer)
    first, second = list(stream._documents_of_pass(0)), list(stream._documents_of_pass(1))
    assert first != second and sorted(map(str, first)) == sorted(map(str, second))
    tokens = sum(len(d["input_ids"]) for d in first)
    bins = iter(stream)
    served = [next(bins) for _ in range(3 * tokens // 32)]  # three passes' worth, all full bins
    assert all(len(b["input_ids"]) == 32 for b in served)


@pytest.mark.parametrize("separate", [True, False])
def test_pretrain_multipack_attn_decides_the_attention_blocks_of_streamed_bins(tmp_path, tiny_tokenizer, separate):
    cfg = validate_config(streamed_text(tmp_path, max_steps=2, pretrain_multipack_attn=separate))
    bins = iter(streaming_dataset(cfg, tiny_tokenizer))
    served = [next(bins) for _ in range(6)]
    if separate:
        assert any(len(b["seq_lens"]) > 1 for b in served)
        assert sum(label == IGNORE_INDEX for b in served for label in b["labels"]) >= sum(
            len(b["seq_lens"]) for b in served
        )
    else:
        assert all(b["seq_lens"] == [32] for b in served)
        assert all(label != IGNORE_INDEX for b in served for label in b["labels"][1:])


RESUMED_RUNS = {
    # 10 rows, 2 a step: a pass is 5 steps.
    "sft": lambda tmp: streamed_sft(
        tmp,
        datasets=[unique_chat_rows(tmp, n=10)],
        micro_batch_size=2,
        sequence_len=64,
        streaming_multipack_buffer_size=4,
    ),
    # 10 short documents, about 4 bins of 32 tokens a pass, 1 bin a step.
    "pretraining": lambda tmp: streamed_text(tmp, micro_batch_size=1, streaming_multipack_buffer_size=4),
}


@pytest.mark.parametrize("name", list(RESUMED_RUNS))
def test_resumed_stream_reproduces_the_uninterrupted_run_across_passes(tmp_path, name):
    """Stopped at step 6 (inside the second pass over the data, reshuffled) and resumed to 8, the run trains on the
    same batches, with the same losses and weights, as the uninterrupted one."""
    common = dict(
        adapter="lora",
        lora_target_linear=True,
        lora_dropout=0.1,  # dropout exercises the restored RNG state
        max_steps=8,
        save_steps=3,
    )
    reference = validate_config({**RESUMED_RUNS[name](tmp_path / "ref"), **common})
    train(reference)
    resumed = validate_config(
        {**RESUMED_RUNS[name](tmp_path / "resumed"), **common, "auto_resume_from_checkpoints": True}
    )
    train(resumed, callbacks=[StopAt(6)])
    assert max(logged_losses(resumed.output_dir)) == 6
    train(resumed)
    expected, got = logged_losses(reference.output_dir), logged_losses(resumed.output_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)
    counters = [
        trainer_state(d)["stateful_callbacks"]["TokenCounter"] for d in (resumed.output_dir, reference.output_dir)
    ]
    assert counters[0] == counters[1]
    final, ref_final = final_weights(resumed.output_dir), final_weights(reference.output_dir)
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], atol=1e-6, rtol=1e-5)
