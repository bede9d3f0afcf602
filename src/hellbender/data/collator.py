"""Batch collation for causal LM training, plain and packed.

Packed rows carry `seq_lens`. A packed batch is its token ids, labels and position ids that restart at every
document, and no attention mask, whatever the attention backend: transformers finds the documents where the
position ids restart and builds every layer's own mask from them (masking_utils' packed-sequence detection),
so a sliding-window or chunked layer attends within the window of its own document, a full-attention layer to its
whole document, and nothing crosses a document boundary. It does so for SDPA, eager and flex attention (one
dense mask per layer pattern for SDPA and eager, a sparse block mask for flex) when the batch has no attention
mask and the forward builds no KV cache (`forward_kwargs` turns the cache off); flash attention, and the flash
kernels from the hub that transformers calls through the same wrapper, read the boundaries from the position ids
in the kernel. A single 4-D mask passed by the collator would reach every layer as it is, so sliding-window layers
would attend to a whole packed document. The few model families whose forward builds its masks without the
position ids get theirs from `models/packed_attention.py`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK

# Key the trainer pops before the forward pass: real (non-padding) tokens per row. One value per row, not one
# per batch, so that accelerate can concatenate and split it like every other batch entry.
REAL_TOKENS_KEY = "num_real_tokens"


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """What a training or evaluation forward adds to a collated batch. A packed batch (no attention mask) is
    isolated by document only if transformers sees no KV cache: with one (most models' `use_cache` default), its mask builder skips the packed-sequence detection and documents attend to each other
    (measured with flex attention: logits 0.6 off the documents run alone). The Trainer turns `use_cache` off on the
    model's top-level config only, which a composite model's inner text model does not read, so the forward is
    told directly."""
    if "position_ids" in batch and "attention_mask" not in batch:
        return {"use_cache": False}
    return {}


def teacher_target_batch(rows: list[dict[str, Any]], longest: int) -> dict[str, torch.Tensor]:
    """The rows' per-token teacher targets (knowledge distillation) as [batch, tokens, k] tensors, k the most any
    position holds: token ids (0 where padded), log-probabilities and `target_mask` (true where a target is)."""
    k = max((len(position) for row in rows for position in row[TARGET_IDS]), default=0)
    k = max(k, 1)
    shape = (len(rows), longest, k)
    ids = torch.zeros(shape, dtype=torch.long)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        counts = torch.tensor([len(position) for position in row[TARGET_IDS]], dtype=torch.long)
        if not int(counts.sum()):
            continue
        # Scattered in one go (a loop over positions costs more than the step at long sequences).
        token = torch.repeat_interleave(torch.arange(len(counts)), counts)
        slot = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        ids[i, token, slot] = torch.tensor(list(itertools.chain.from_iterable(row[TARGET_IDS])), dtype=torch.long)
        logprobs[i, token, slot] = torch.tensor(
            list(itertools.chain.from_iterable(row[TARGET_LOGPROBS])), dtype=torch.float32
        )
        mask[i, token, slot] = True
    return {TARGET_IDS: ids, TARGET_LOGPROBS: logprobs, TARGET_MASK: mask}


def one_packed_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Packed rows joined end to end, without the padding between them. transformers' flash attention (and the hub
    kernels called through its wrapper) finds packed documents from restarting position ids only in a batch of one
    row; a batch of several rows would attend across the documents of each row. Joined, every row's documents stay
    documents, and each row's first token, which no earlier token predicts within its own row, stays unpredicted."""
    joined: dict[str, list] = {key: [] for key in ("input_ids", "labels", "seq_lens", TARGET_IDS, TARGET_LOGPROBS)}
    for row in rows:
        joined["input_ids"] += row["input_ids"]
        joined["labels"] += [IGNORE_INDEX, *row["labels"][1:]]
        joined["seq_lens"] += row["seq_lens"]
        if TARGET_IDS in row:  # the teacher's targets predict each token from the one before it, like the labels
            joined[TARGET_IDS] += [[], *row[TARGET_IDS][1:]]
            joined[TARGET_LOGPROBS] += [[], *row[TARGET_LOGPROBS][1:]]
    return {key: value for key, value in joined.items() if key in rows[0]}


def token_tensor(values: Any) -> torch.Tensor:
    """A row's token ids (or labels) as an int64 tensor. Rows arrive as Python lists; numpy converts a list of
    ints about 6x faster than torch does (40 µs against 240 µs for 2,048 tokens), which the host pays between two
    optimizer steps."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


@dataclass
class CausalLMCollator:
    pad_token_id: int
    pad_to_multiple_of: int | None = None
    # The token that fills a packed row after its last document (default: padding). A block of padding alone can
    # have all-zero hidden states, which a model that takes their root without an epsilon turns into NaN gradients
    # (models/fixes/gemma3n.py).
    packed_tail_token_id: int | None = None
    # Join a batch's packed rows into one row (see `one_packed_row`): for attention that reads the documents from
    # the position ids (flash attention), which transformers does for a batch of one row only.
    one_row_per_batch: bool = False

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.one_row_per_batch and "seq_lens" in rows[0] and len(rows) > 1:
            rows = [one_packed_row(rows)]
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
        lengths = [len(r["input_ids"]) for r in rows]
        for i, row in enumerate(rows):
            input_ids[i, : lengths[i]] = token_tensor(row["input_ids"])
            labels[i, : lengths[i]] = token_tensor(row["labels"])
        out = {"input_ids": input_ids, "labels": labels, REAL_TOKENS_KEY: torch.tensor(lengths)}
        if TARGET_IDS in rows[0]:
            out.update(teacher_target_batch(rows, longest))
        if "seq_lens" not in rows[0]:
            positions = torch.arange(longest)[None, :]
            out["attention_mask"] = (positions < torch.tensor(lengths)[:, None]).long()
            return out

        position_ids = torch.zeros((batch, longest), dtype=torch.long)
        for i, row in enumerate(rows):
            start = 0
            for n in row["seq_lens"]:
                position_ids[i, start : start + n] = torch.arange(n)
                start += n
            # Padding after the last document restarts from zero too: a block of its own, which no real token
            # attends to (its labels are ignored).
            position_ids[i, start:] = torch.arange(longest - start)
            if self.packed_tail_token_id is not None:
                input_ids[i, start:] = self.packed_tail_token_id
        out["position_ids"] = position_ids
        return out
