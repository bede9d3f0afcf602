"""`pad_to_sequence_len` pads every batch to `sequence_len` without changing what is computed; `eval_sample_packing`
packs (or not) the evaluation rows on their own; `ddp_find_unused_parameters` reaches the Trainer."""

from __future__ import annotations

from hellbender.config import validate_config
from hellbender.data.batching import build_collator
from hellbender.data.prepare import prepare_datasets
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses


def test_pad_to_sequence_len_pads_every_batch_to_the_same_shape(tmp_path, tiny_tokenizer):
    cfg = validate_config(base_config(tmp_path, pad_to_sequence_len=True, sequence_len=96))
    batch = build_collator(cfg, tiny_tokenizer, None)([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}])
    assert batch["input_ids"].shape == (1, 96)
    assert batch["attention_mask"].sum() == 3 and (batch["labels"][0, 3:] == -100).all()


def test_pad_to_sequence_len_trains_to_the_same_losses(tmp_path):
    plain = validate_config(base_config(tmp_path / "plain", max_steps=3))
    padded = validate_config(base_config(tmp_path / "padded", max_steps=3, pad_to_sequence_len=True))
    train(plain)
    train(padded)
    a, b = logged_losses(plain.output_dir), logged_losses(padded.output_dir)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert abs(b[step] - a[step]) < 1e-5, (a, b)


def test_eval_rows_are_packed_as_eval_sample_packing_says(tmp_path, tiny_tokenizer):
    common = dict(sample_packing=True, val_set_size=0.25)
    default = prepare_datasets(validate_config(base_config(tmp_path / "a", **common)), tiny_tokenizer)
    unpacked = prepare_datasets(
        validate_config(base_config(tmp_path / "b", eval_sample_packing=False, **common)), tiny_tokenizer
    )
    assert "seq_lens" in default.eval.column_names  # packed like the training rows
    assert "seq_lens" not in unpacked.eval.column_names
    assert len(unpacked.eval) > len(default.eval)
    assert len(unpacked.train) == len(default.train)


def test_ddp_find_unused_parameters_reaches_the_trainer(tmp_path):
    from hellbender.train.arguments import training_arguments
    from hellbender.train.schedule import plan_schedule

    for value in (True, False, None):
        cfg = validate_config(base_config(tmp_path, ddp_find_unused_parameters=value))
        args = training_arguments(cfg, plan_schedule(cfg, 100), has_eval=False)
        assert args.ddp_find_unused_parameters is value
