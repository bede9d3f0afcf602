"""Batch collation for causal LM training, plain and packed.

Packed rows carry `seq_lens`. Position ids restart at every document. Attention must not cross documents:
with SDPA or eager attention, restarting position ids does not stop a document attending to the one before
it, so the collator builds a 4-D block-diagonal causal mask: boolean for SDPA (True = attend), additive
float for eager attention, which adds the mask to the scores. Flash attention instead reads the document
boundaries from the restarting position ids (transformers' packed-sequence support) and gets no mask; so do
flash-attention kernels from the hub (`attn_implementation: owner/repo`), which transformers calls through the same
wrapper (`models/hub_kernels.py` refuses packing with a hub kernel it does not wrap that way). So does flex
attention: transformers' mask builder finds the documents where position ids restart and builds a sparse block mask
from them (never a dense [seq, seq] one), combined with each layer's own pattern (sliding window, chunks). It does so
only when the batch has no attention mask and the forward builds no KV cache: the forward must get
`use_cache=False` (`forward_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hellbender.config.model import is_hub_kernel
from hellbender.data.formats.base import IGNORE_INDEX

# Attention backends that isolate packed documents from position ids alone.
POSITION_ID_PACKING_BACKENDS = ("flash_attention_2", "flash_attention_3", "flex_attention")
# Key the trainer pops before the forward pass: real (non-padding) tokens per row. One value per row, not one
# per batch, so that accelerate can concatenate and split it like every other batch entry.
REAL_TOKENS_KEY = "num_real_tokens"


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """What a training or evaluation forward adds to a collated batch. A packed batch without an attention mask
    (flash and flex attention) is isolated by document only if transformers sees no KV cache: with one (most models'
    `use_cache` default), its mask builder skips the packed-sequence detection and documents attend to each other
    (measured with flex attention: logits 0.6 off the documents run alone). The Trainer turns `use_cache` off on the
    model's top-level config only, which a composite model's inner text model does not read, so the forward is
    told directly."""
    if "position_ids" in batch and "attention_mask" not in batch:
        return {"use_cache": False}
    return {}


def block_diagonal_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean mask: position i may attend to j <= i of the same document."""
    seq = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal)[:, None, :, :]


@dataclass
class CausalLMCollator:
    pad_token_id: int
    attn_implementation: str = "sdpa"
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
        lengths = [len(r["input_ids"]) for r in rows]
        for i, row in enumerate(rows):
            input_ids[i, : lengths[i]] = torch.as_tensor(row["input_ids"])
            labels[i, : lengths[i]] = torch.as_tensor(row["labels"])
        out = {"input_ids": input_ids, "labels": labels, REAL_TOKENS_KEY: torch.tensor(lengths)}
        if "seq_lens" not in rows[0]:
            positions = torch.arange(longest)[None, :]
            out["attention_mask"] = (positions < torch.tensor(lengths)[:, None]).long()
            return out

        position_ids = torch.zeros((batch, longest), dtype=torch.long)
        doc_ids = torch.full((batch, longest), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            start = 0
            for doc, n in enumerate(row["seq_lens"]):
                position_ids[i, start : start + n] = torch.arange(n)
                doc_ids[i, start : start + n] = doc
                start += n
            # Padding after the last document: its own block, positions counting on from zero.
            position_ids[i, start:] = torch.arange(longest - start)
        out["position_ids"] = position_ids
        if self.attn_implementation in POSITION_ID_PACKING_BACKENDS or is_hub_kernel(self.attn_implementation):
            return out
        mask = block_diagonal_causal_mask(doc_ids)
        if self.attn_implementation == "eager":
            additive = torch.zeros(mask.shape, dtype=torch.float32)
            mask = additive.masked_fill_(~mask, torch.finfo(torch.float32).min)
        out["attention_mask"] = mask
        return out
