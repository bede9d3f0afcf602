"""One process of a context-parallel group on CPU (gloo), started by tests/test_context_parallel.py through torchrun.

Every process builds the same packed batch and the same tiny Llama (float64), runs the whole batch in one piece
with SDPA (the reference: transformers separates the packed documents by their position ids), then its own share of
the rows with the split attention (`models/split_attention.py`), as the trainer cuts them (`train/row_split.py`).
It writes, per process: the largest difference between its logits and the reference's at the same positions, and
after summing the processes' losses and gradients, their largest differences from the reference's. The same run
with each row taken as one document (packing ignored) is written too, so the comparison can be seen to fail.

Usage: split_attention_worker.py MODEL_DIR RESULT_DIR
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hellbender.data.collator import REAL_TOKENS_KEY
from hellbender.models.split_attention import RowSplit, splitting_rows, use_split_attention
from hellbender.train.row_split import split_rows
from hellbender.train.trainer import causal_lm_loss

LENGTH = 24  # a multiple of 2 x 2 chunks
# Per row: its documents' lengths, then padding to LENGTH; documents cross the chunk boundaries (every 6 tokens).
DOCUMENTS = ([5, 9, 4, 3], [13, 8])


def packed_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (len(DOCUMENTS), LENGTH), generator=generator)
    labels, positions = ids.clone(), torch.zeros_like(ids)
    real = []
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for n in [*lengths, LENGTH - sum(lengths)]:
            positions[row, start : start + n] = torch.arange(n)
            labels[row, start] = -100  # a document's first token is predicted by nothing before it
            start += n
        labels[row, sum(lengths) :] = -100
        labels[row, 1:4] = -100  # an untrained prompt
        real.append(sum(lengths))
    return {"input_ids": ids, "labels": labels, "position_ids": positions, REAL_TOKENS_KEY: torch.tensor(real)}


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def main(model_dir: str, result_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    split_model = copy.deepcopy(reference)
    use_split_attention(split_model)
    # The layers run again in backward, from the split the step set, as under hellbender's checkpointing.
    split_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    split_model.train()
    batch = packed_batch()
    trained = (batch["labels"][:, 1:] != -100).sum()

    out = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    causal_lm_loss(out, batch["labels"], num_items_in_batch=trained).backward()
    expected_grads, expected_logits = gradients(reference), out.logits.detach()
    expected_loss = causal_lm_loss(out, batch["labels"], num_items_in_batch=trained).detach()

    def run_split(ignore_documents: bool) -> dict[str, float]:
        split_model.zero_grad()
        share, split = split_rows(batch, dist.group.WORLD, size, rank)
        if ignore_documents:  # each row one causal document: what plain ring attention computes
            split = RowSplit(split.group, split.size, split.rank, split.length, (((0, LENGTH),),) * len(DOCUMENTS))
        with splitting_rows(split):
            out = split_model(input_ids=share["input_ids"], position_ids=share["position_ids"], use_cache=False)
            loss = causal_lm_loss(out, None, num_items_in_batch=trained, shift_labels=share["shift_labels"])
            loss.backward()
        index = split.local_index()
        logits_diff = (out.logits.detach() - expected_logits[:, index]).abs().max().item()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = gradients(split_model)
        for grad in grads.values():
            dist.all_reduce(grad)
        grad_diff = max((grads[name] - expected_grads[name]).abs().max().item() for name in expected_grads)
        return {
            "logits": logits_diff,
            "loss": abs(total.item() - expected_loss.item()),
            "gradients": grad_diff,
            "real_tokens": int(share[REAL_TOKENS_KEY].sum()),
            "trained_tokens": int((share["shift_labels"] != -100).sum()),
        }

    result = {
        "rank": rank,
        "documents": run_split(ignore_documents=False),
        "one_document_per_row": run_split(ignore_documents=True),
        "largest_gradient": max(g.abs().max().item() for g in expected_grads.values()),
        "trained": int(trained),
        "real": int(batch[REAL_TOKENS_KEY].sum()),
    }
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
