"""Which prepared rows are kept and in what order they train: `dataset_exact_deduplication`, `min_sample_len`,
`sample_packing_sequentially`, `curriculum_sampling` and `group_by_length`, each on the real preparation and
Trainer path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hellbender.config import validate_config
from hellbender.data.collator import REAL_TOKENS_KEY
from hellbender.data.packing import pack_lengths_in_order
from hellbender.data.prepare import prepare_datasets
from hellbender.errors import ConfigError
from tests.conftest import write_jsonl
from tests.helpers import base_config

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


def texts(n: int) -> list[str]:
    """`n` different texts of different lengths."""
    return [f"number {i}: " + " ".join(WORDS[: 1 + i % len(WORDS)]) for i in range(n)]


def completion_config(tmp_path: Path, rows: list[str], **top) -> dict:
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in rows])
    return base_config(tmp_path, datasets=[{"path": str(data), "type": "completion"}], **top)


def prepared(tmp_path: Path, tokenizer, rows: list[str], **top):
    return prepare_datasets(validate_config(completion_config(tmp_path, rows, **top)), tokenizer)


def row_keys(ds) -> list[tuple]:
    return [(tuple(r["input_ids"]), tuple(r["labels"])) for r in ds]


# --- dataset_exact_deduplication -------------------------------------------------------------------------------


def test_duplicate_rows_are_dropped_and_counted(tmp_path, tiny_tokenizer):
    rows = texts(6) + texts(6)[:4] + texts(6)[:2]  # 6 different rows, 6 repeats
    kept = prepared(tmp_path, tiny_tokenizer, rows, dataset_exact_deduplication=True)
    keys = row_keys(kept.train)
    assert len(keys) == len(set(keys)) == 6
    assert kept.stats["train"]["rows_dropped"] == {"duplicate": 6}
    assert kept.stats["train"]["rows_kept"] == 6
    assert kept.stats["train"]["tokens"] == sum(len(k[0]) for k in keys)

    plain = prepared(tmp_path, tiny_tokenizer, rows)
    assert len(plain.train) == 12 and len(set(row_keys(plain.train))) == 6
    assert plain.cache_dir != kept.cache_dir  # the cache keeps the two preparations apart


def test_same_tokens_with_other_labels_are_not_duplicates(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "say hi", "input": "", "output": "hi"}] * 3
    data = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    entries = [{"path": str(data), "type": "alpaca"}, {"path": str(data), "type": "alpaca", "train_on_inputs": True}]
    cfg = validate_config(base_config(tmp_path, datasets=entries, dataset_exact_deduplication=True))
    train = prepare_datasets(cfg, tiny_tokenizer).train
    assert len(train) == 2
    assert len({tuple(r["input_ids"]) for r in train}) == 1  # the same tokens, trained differently


def test_held_out_rows_never_repeat_a_training_row(tmp_path, tiny_tokenizer):
    rows = texts(10) * 3
    data = prepared(tmp_path, tiny_tokenizer, rows, dataset_exact_deduplication=True, val_set_size=4)
    assert len(data.train) == 6 and len(data.eval) == 4
    assert not set(row_keys(data.train)) & set(row_keys(data.eval))


def test_evaluation_datasets_are_deduplicated_too(tmp_path, tiny_tokenizer):
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": t} for t in texts(3) * 2])
    data = prepared(
        tmp_path,
        tiny_tokenizer,
        texts(4),
        dataset_exact_deduplication=True,
        test_datasets=[{"path": str(test), "type": "completion"}],
    )
    assert len(data.eval) == 3
    assert data.stats["eval"]["rows_dropped"] == {"duplicate": 3}


# --- min_sample_len ---------------------------------------------------------------------------------------------


def test_rows_shorter_than_min_sample_len_are_dropped(tmp_path, tiny_tokenizer):
    rows = texts(12)
    lengths = sorted(len(r["input_ids"]) for r in prepared(tmp_path, tiny_tokenizer, rows).train)
    cut = lengths[5]  # some rows are shorter, this one is exactly as long
    data = prepared(tmp_path, tiny_tokenizer, rows, min_sample_len=cut)
    kept = sorted(data.train["length"])
    assert kept == [n for n in lengths if n >= cut]  # a row of exactly `min_sample_len` tokens is kept
    assert data.stats["train"]["rows_dropped"] == {"shorter than min_sample_len": sum(n < cut for n in lengths)}


def test_min_sample_len_longer_than_sequence_len_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`min_sample_len: 200` is more than `sequence_len: 128`"):
        validate_config(completion_config(tmp_path, texts(2), min_sample_len=200))


# --- sample_packing_sequentially and curriculum_sampling --------------------------------------------------------


def test_in_order_packing_keeps_consecutive_rows_together():
    assert pack_lengths_in_order([4, 5, 3, 8, 2, 2, 10], 10) == [[0, 1], [2], [3, 4], [5], [6]]
    with pytest.raises(ValueError, match="row 1 has 11 tokens"):
        pack_lengths_in_order([3, 11], 10)


def documents(packed) -> list[tuple]:
    """The documents of packed bins, bin after bin."""
    docs = []
    for row in packed:
        start = 0
        for n in row["seq_lens"]:
            docs.append(tuple(row["input_ids"][start : start + n]))
            start += n
    return docs


def test_sequential_packing_packs_the_rows_in_their_prepared_order(tmp_path, tiny_tokenizer):
    rows = texts(40)
    unpacked = prepared(tmp_path, tiny_tokenizer, rows)  # shuffled, as packing sees them
    seq = prepared(tmp_path, tiny_tokenizer, rows, sample_packing=True, sample_packing_sequentially=True)
    assert documents(seq.train) == [tuple(r["input_ids"]) for r in unpacked.train]
    assert all(sum(r["seq_lens"]) <= 128 for r in seq.train)
    best_fit = prepared(tmp_path, tiny_tokenizer, rows, sample_packing=True)
    assert documents(best_fit.train) != documents(seq.train)  # best fit sorts by length
    assert best_fit.cache_dir != seq.cache_dir


def test_curriculum_sampling_prepares_the_rows_in_file_order(tmp_path, tiny_tokenizer):
    rows = texts(40)
    cfg = validate_config(completion_config(tmp_path, rows, curriculum_sampling=True, sample_packing=True))
    assert cfg.shuffle_merged_datasets is False and cfg.sample_packing_sequentially is True  # what validate prints
    packed = prepare_datasets(cfg, tiny_tokenizer).train
    in_file_order = [tuple(tiny_tokenizer(t)["input_ids"]) for t in rows]
    assert [d[: len(f)] for d, f in zip(documents(packed), in_file_order, strict=True)] == in_file_order


def test_an_unshuffled_split_keeps_the_training_rows_in_order(tmp_path, tiny_tokenizer):
    rows = texts(30)
    data = prepared(tmp_path, tiny_tokenizer, rows, curriculum_sampling=True, val_set_size=0.2)
    assert len(data.eval) == 6
    order = {tuple(tiny_tokenizer(t)["input_ids"]): i for i, t in enumerate(rows)}

    def positions(ds) -> list[int]:
        return [next(i for ids, i in order.items() if tuple(r["input_ids"][: len(ids)]) == ids) for r in ds]

    assert positions(data.train) == sorted(positions(data.train))
    assert positions(data.eval) != list(range(24, 30))  # held out at random, not the last rows


# --- the Trainer's order ----------------------------------------------------------------------------------------


def trainer_for(cfg, tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from hellbender.data.batching import build_collator
    from hellbender.train.arguments import training_arguments
    from hellbender.train.schedule import plan_schedule
    from hellbender.train.trainer import HellbenderTrainer

    train = prepare_datasets(cfg, tokenizer).train
    return HellbenderTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=training_arguments(cfg, plan_schedule(cfg, len(train)), has_eval=False),
        train_dataset=train,
        data_collator=build_collator(cfg, tokenizer, None),
        processing_class=tokenizer,
    )


def epoch_rows(trainer, epoch: int) -> list[list[tuple]]:
    """The rows of each batch the Trainer's data loader gives in `epoch` (set as the Trainer sets it)."""
    loader = trainer.get_train_dataloader()
    loader.set_epoch(epoch)
    batches = []
    for batch in loader:
        lengths = batch[REAL_TOKENS_KEY].tolist()
        batches.append([tuple(ids[:n]) for ids, n in zip(batch["input_ids"].tolist(), lengths, strict=True)])
    return batches


def padding(batches: list[list[tuple]]) -> int:
    return sum(len(b) * max(map(len, b)) - sum(map(len, b)) for b in batches)


def test_curriculum_sampling_trains_the_rows_in_file_order_every_epoch(tmp_path, tiny_tokenizer, tiny_model_path):
    rows = texts(12)
    cfg = validate_config(completion_config(tmp_path, rows, curriculum_sampling=True, micro_batch_size=4))
    trainer = trainer_for(cfg, tiny_tokenizer, tiny_model_path)
    in_file_order = [tuple(tiny_tokenizer(t)["input_ids"]) for t in rows]
    for epoch in (0, 1):
        seen = [row for batch in epoch_rows(trainer, epoch) for row in batch]
        assert [r[: len(f)] for r, f in zip(seen, in_file_order, strict=True)] == in_file_order


def test_group_by_length_batches_similar_lengths_in_a_seeded_order(tmp_path, tiny_tokenizer, tiny_model_path):
    rows = texts(64)
    grouped_cfg = validate_config(completion_config(tmp_path, rows, group_by_length=True, micro_batch_size=4))
    grouped = trainer_for(grouped_cfg, tiny_tokenizer, tiny_model_path)
    random = trainer_for(
        validate_config(completion_config(tmp_path, rows, micro_batch_size=4)), tiny_tokenizer, tiny_model_path
    )
    first, second = epoch_rows(grouped, 0), epoch_rows(grouped, 1)
    assert sorted(r for b in first for r in b) == sorted(r for b in second for r in b)  # every row once an epoch
    assert first != second  # shuffled anew each epoch
    assert padding(first) < padding(epoch_rows(random, 0)) / 2
    # A fresh Trainer (a resumed run, another process) draws the same order for the same epoch.
    again = trainer_for(grouped_cfg, tiny_tokenizer, tiny_model_path)
    assert epoch_rows(again, 1) == second


def test_group_by_length_trains(tmp_path):
    from hellbender.train.run import train

    metrics = train(validate_config(completion_config(tmp_path, texts(16), group_by_length=True, max_steps=2)))
    assert metrics["train_loss"] > 0


# --- refused combinations ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"group_by_length": True, "sample_packing": True}, r"`group_by_length` cannot work with `sample_packing`"),
        (
            {"group_by_length": True, "curriculum_sampling": True},
            r"`group_by_length` and `curriculum_sampling` contradict",
        ),
        ({"sample_packing_sequentially": True}, r"`sample_packing_sequentially: true` chooses how rows are packed"),
        (
            {"curriculum_sampling": True, "shuffle_merged_datasets": True},
            r"`shuffle_merged_datasets: true` shuffles that order away",
        ),
        (
            {"curriculum_sampling": True, "sample_packing": True, "sample_packing_sequentially": False},
            r"`sample_packing_sequentially: false` packs them by best fit",
        ),
    ],
)
def test_order_keys_that_cannot_work_together_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(completion_config(tmp_path, texts(2), **keys))


@pytest.mark.parametrize(
    "key", [{"dataset_exact_deduplication": True}, {"min_sample_len": 10}, {"group_by_length": True}]
)
def test_keys_of_prepared_rows_are_refused_for_streamed_rows(tmp_path, key):
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "some words"}] * 4)
    raw = base_config(tmp_path, datasets=[], pretraining_dataset=[{"path": str(text)}], max_steps=2, **key)
    with pytest.raises(ConfigError, match=rf"`{next(iter(key))}` .* streamed `pretraining_dataset`"):
        validate_config(raw)


def test_curriculum_sampling_is_refused_for_streamed_rows(tmp_path):
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "some words"}] * 4)
    raw = base_config(
        tmp_path, datasets=[], pretraining_dataset=[{"path": str(text)}], max_steps=2, curriculum_sampling=True
    )
    with pytest.raises(ConfigError, match=r"`curriculum_sampling` .* shuffle buffer"):
        validate_config(raw)


# --- did-you-mean ----------------------------------------------------------------------------------------------


def test_an_unknown_key_is_not_taken_for_a_key_that_cannot_hold_its_value(tmp_path):
    with pytest.raises(ConfigError) as refused:
        validate_config(base_config(tmp_path, test_value=True))
    assert "`test_value` is not a config key" in str(refused.value)
    assert "test_datasets" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"`test_dataset` is not a config key\. Did you mean `test_datasets`\?"):
        validate_config(base_config(tmp_path, test_dataset=[{"path": "x.jsonl"}]))
