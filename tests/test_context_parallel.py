"""`context_parallel_size`: what it is checked against when a config is read, the device mesh it asks accelerate
for, the rows' padding, and the loss of a row split into slices (each process's share under context parallelism)
adding up to the loss of the whole row. The two-GPU run against one GPU is in tests/test_gpu_multi.py."""

from __future__ import annotations

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from tests.helpers import base_config

FSDP2 = {"fsdp_version": 2, "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}


def split_config(tmp_path, **overrides) -> dict:
    return base_config(tmp_path, **{"context_parallel_size": 2, "sample_packing": False, **FSDP2, **overrides})


def test_a_context_parallel_config_is_accepted_and_its_older_spelling_too(tmp_path):
    assert validate_config(split_config(tmp_path)).context_parallel_size == 2
    older = base_config(tmp_path, sequence_parallel_degree=2, sample_packing=False, **FSDP2)
    assert validate_config(older).context_parallel_size == 2


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"fsdp_version": None, "fsdp_config": None}, "add `fsdp_version: 2`"),
        ({"sample_packing": True}, "packed documents would attend to each other"),
        ({"attn_implementation": "eager"}, "needs `attn_implementation: sdpa`"),
        ({"torch_compile": True}, "not with `torch_compile`"),
        ({"liger_fused_linear_cross_entropy": True}, "fused cross-entropy"),
        ({"heads_k_stride": 1}, "ring-flash-attn"),
    ],
    ids=["no-fsdp2", "packing", "eager", "compile", "fused-loss", "ring-flash-attn-key"],
)
def test_what_context_parallelism_cannot_be_combined_with_is_refused_by_name(tmp_path, overrides, needle):
    raw = {**split_config(tmp_path), **overrides}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match="context_parallel_size|heads_k_stride") as error:
        validate_config(raw)
    assert needle in str(error.value)


def test_the_mesh_splits_the_processes_into_context_groups_and_refuses_a_remainder(tmp_path):
    from hellbender.train.fsdp import parallelism_config

    cfg = validate_config(split_config(tmp_path))
    mesh = parallelism_config(cfg, 4)
    assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.cp_size) == (1, 2, 2)
    mesh = parallelism_config(cfg, 2)
    assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.cp_size) == (1, 1, 2)
    hybrid = validate_config(split_config(tmp_path, dp_replicate_size=2, dp_shard_size=2))
    mesh = parallelism_config(hybrid, 8)
    assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.cp_size) == (2, 2, 2)
    with pytest.raises(ConfigError, match="groups of 2 processes, but this run has 3"):
        parallelism_config(cfg, 3)
    assert parallelism_config(validate_config(base_config(tmp_path, **FSDP2)), 2) is None  # plain FSDP2


def test_rows_are_padded_to_a_multiple_of_twice_the_context_groups(tmp_path, tiny_tokenizer):
    from hellbender.data.batching import build_collator

    collator = build_collator(validate_config(split_config(tmp_path, context_parallel_size=3)), tiny_tokenizer, None)
    batch = collator([{"input_ids": [5] * 7, "labels": [5] * 7}, {"input_ids": [6] * 3, "labels": [6] * 3}])
    assert batch["input_ids"].shape == (2, 12)
    assert batch["attention_mask"].sum(1).tolist() == [7, 3]


def test_the_slices_of_a_row_add_up_to_the_loss_of_the_whole_row():
    """Each process scores its slice with the labels shifted before the row was cut (`shift_labels`), divided by
    the whole batch's trained tokens: the slices' losses sum to the whole row's. With the labels shifted inside each
    slice instead, the token after each slice's last one would be lost."""
    from hellbender.train.trainer import causal_lm_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 12, 30, dtype=torch.float64)
    labels = torch.randint(0, 30, (2, 12))
    labels[0, :3] = -100
    trained = (labels[:, 1:] != -100).sum()
    whole = causal_lm_loss({"logits": logits}, labels, num_items_in_batch=trained)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    slices = [slice(0, 3), slice(3, 9), slice(9, 12)]
    parts = [
        causal_lm_loss({"logits": logits[:, s]}, labels[:, s], num_items_in_batch=trained, shift_labels=shift[:, s])
        for s in slices
    ]
    assert torch.allclose(sum(parts), whole, rtol=1e-6)  # the loss is computed in float32
    unshifted = sum(causal_lm_loss({"logits": logits[:, s]}, labels[:, s], num_items_in_batch=trained) for s in slices)
    assert not torch.allclose(unshifted, whole, rtol=1e-3)


def test_the_trainer_scores_a_slice_with_the_labels_shifted_before_the_cut(tmp_path, tiny_model_path):
    """What the Trainer hands `compute_loss` under context parallelism: one process's slice of the row with
    `shift_labels`. hellbender's loss uses them (not the slice's own labels shifted again), and its token counts
    are the slice's."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hellbender.data.collator import REAL_TOKENS_KEY
    from hellbender.train.tokens import TokenCounter
    from hellbender.train.trainer import HellbenderTrainer, causal_lm_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = HellbenderTrainer(model=model, args=args, callbacks=[TokenCounter()])
    torch.manual_seed(0)
    ids = torch.randint(5, 500, (1, 16))
    labels = ids.clone()
    labels[0, :5] = -100
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    part = slice(0, 8)  # the first half, as one of two processes holds it: its last token predicts the 9th
    inputs = {
        "input_ids": ids[:, part],
        "labels": labels[:, part],
        "shift_labels": shift[:, part],
        "attention_mask": torch.ones(1, 8, dtype=torch.long),
        "position_ids": torch.arange(8)[None],
        REAL_TOKENS_KEY: torch.tensor([16]),
    }
    trained = (shift != -100).sum()
    model.train()
    loss = trainer.compute_loss(model, dict(inputs), num_items_in_batch=trained)
    with torch.no_grad():
        logits = model(input_ids=ids[:, part], position_ids=torch.arange(8)[None]).logits
    expected = causal_lm_loss({"logits": logits}, None, num_items_in_batch=trained, shift_labels=shift[:, part])
    assert torch.allclose(loss, expected, rtol=1e-5)
    unshifted = causal_lm_loss({"logits": logits}, labels[:, part], num_items_in_batch=trained)
    assert not torch.allclose(loss, unshifted, rtol=1e-3)
    counter = trainer.token_counter()
    assert (counter._step_input, counter._step_trained) == (8, 4)  # the slice's tokens; positions 4-7 are trained
