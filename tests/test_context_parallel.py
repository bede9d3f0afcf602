"""`context_parallel_size`: what it is checked against when a config is read, the device mesh it asks accelerate
for, the rows' padding, and the loss of a row split into slices (each process's share under context parallelism)
adding up to the loss of the whole row. The two-GPU run against one GPU is in tests/test_gpu_multi.py."""

from __future__ import annotations

from pathlib import Path

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
        ({"attn_implementation": "eager"}, "needs `attn_implementation: sdpa`"),
        ({"torch_compile": True}, "not with `torch_compile`"),
        ({"liger_fused_linear_cross_entropy": True}, "fused cross-entropy"),
        ({"heads_k_stride": 1}, "ring-flash-attn"),
    ],
    ids=["no-fsdp2", "eager", "compile", "fused-loss", "ring-flash-attn-key"],
)
def test_what_context_parallelism_cannot_be_combined_with_is_refused_by_name(tmp_path, overrides, needle):
    raw = {**split_config(tmp_path), **overrides}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match="context_parallel_size|heads_k_stride") as error:
        validate_config(raw)
    assert needle in str(error.value)


def test_packed_rows_are_split_with_the_attention_that_keeps_their_documents_apart(tmp_path):
    assert not validate_config(split_config(tmp_path)).splits_packed_rows  # padded rows: PyTorch's ring attention
    assert validate_config(split_config(tmp_path, sample_packing=True)).splits_packed_rows
    assert validate_config(split_config(tmp_path, eval_sample_packing=True)).splits_packed_rows


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
    counter.on_step_end(args, trainer.state, trainer.control)
    assert (counter.input_tokens, counter.trained_tokens) == (8, 4)  # the slice's tokens; positions 4-7 are trained


def test_a_process_holds_the_two_chunks_the_ring_layout_gives_it_and_each_document_piece_once():
    """Rows of 16 tokens over 2 processes: 4 chunks of 4, process 0 holds chunks 0 and 3, process 1 chunks 1 and 2.
    The attention pieces cover each held token once, in the order held, and reach back to their document's start."""
    from hellbender.models.split_attention import RowSplit

    documents = (((0, 6), (6, 13), (13, 16)),)
    first, second = (RowSplit(None, 2, rank, 16, documents) for rank in (0, 1))
    assert first.local_index().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert second.local_index().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = torch.cat([first.local_index(), second.local_index()])
    assert torch.equal(held[first.gathered_order()], torch.arange(16))
    assert first.pieces(0) == [(0, 4, 0, 4), (4, 5, 6, 13), (5, 8, 13, 16)]
    assert second.pieces(0) == [(0, 2, 0, 6), (2, 4, 6, 8), (4, 8, 6, 12)]
    # Every layer asks again: the order is made (and copied to the device) once per step, not once per layer.
    assert first.gathered_order() is first.gathered_order()
    assert first.pieces(0) == [(0, 4, 0, 4), (4, 5, 6, 13), (5, 8, 13, 16)]


def test_a_packed_batch_is_cut_with_its_next_tokens_and_real_token_counts(tmp_path):
    from hellbender.data.collator import REAL_TOKENS_KEY
    from hellbender.train.row_split import split_rows

    ids = torch.arange(100, 108)[None]
    labels = ids.clone()
    labels[0, [0, 3]] = -100  # the two documents' first tokens
    batch = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]]),  # documents of 3 and 2 tokens, then 3 of padding
        REAL_TOKENS_KEY: torch.tensor([5]),
    }
    share, split = split_rows(batch, None, 2, 1)  # process 1 of 2: chunks 1 and 2, tokens 2-5
    assert split.documents == (((0, 3), (3, 5), (5, 8)),)
    assert share["input_ids"].tolist() == [[102, 103, 104, 105]]
    assert share["position_ids"].tolist() == [[2, 0, 1, 0]]
    assert share["shift_labels"].tolist() == [[-100, 104, 105, 106]]  # token 5's next one lies in process 0's chunk
    assert share[REAL_TOKENS_KEY].tolist() == [3]
    with pytest.raises(ValueError, match="2 x 2 equal chunks"):
        split_rows({**batch, "labels": labels[:, :6]}, None, 2, 0)


def test_packed_rows_split_over_two_processes_compute_the_whole_rows_exactly(tmp_path, tiny_model_path):
    """Two processes on CPU (gloo), float64: each runs its share of two packed rows (documents crossing the chunk
    boundaries, padding at the end) with the split attention. Its logits equal the whole batch's at the same
    positions, and the processes' losses and gradients summed equal the whole batch's. Taking each row as one
    document instead (what PyTorch's ring attention computes) is far off, so the comparison can fail."""
    import json

    from tests.test_distributed import run_torchrun

    worker = Path(__file__).resolve().parent / "split_attention_worker.py"
    run_torchrun(worker, str(tiny_model_path), str(tmp_path))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        documents, ignored = result["documents"], result["one_document_per_row"]
        assert documents["logits"] < 1e-12 and documents["gradients"] < 1e-12, documents
        assert documents["loss"] < 1e-6, documents  # the loss is reduced in float32
        assert ignored["logits"] > 1e-2 and ignored["gradients"] > 1e-3, ignored
        assert result["largest_gradient"] > 1e-2  # the gradients compared are not all zero
    assert sum(r["documents"]["real_tokens"] for r in results) == results[0]["real"]
    assert sum(r["documents"]["trained_tokens"] for r in results) == results[0]["trained"]
