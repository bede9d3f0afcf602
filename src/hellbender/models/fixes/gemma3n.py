"""Gemma 3n (`gemma3n`, `gemma3n_text`): the padding after the last document of a packed row must not be padding.

At the end of its text model, Gemma 3n rescales each AltUp stream to the magnitude of the first one, taken as
`mean(h ** 2) ** 0.5` without an epsilon. The padding token's embedding rows (its token and per-layer embeddings)
are zero where the model keeps `padding_idx` rows at zero, and a block of padding alone (the tail of a packed row,
which attends only to itself) then keeps zero hidden states through every layer: the root's gradient at zero is
infinite, and although the labels there are ignored, 0 x inf makes every gradient NaN (measured with transformers
5.24 on a tiny model: training stopped as diverged at the first packed step). hellbender fills that tail with
another token for this family; the tail stays a block of its own with ignored labels, so the documents' loss is the
same (tests/test_gemma3n_packing.py checks both the NaN and the fix).
"""

from __future__ import annotations

from typing import Any

MODEL_TYPES = ("gemma3n", "gemma3n_text")


def packed_tail_token_id(model: Any, tokenizer: Any) -> int | None:
    """The token to fill packed rows' tails with for a Gemma 3n `model` (a transformers or PEFT model): the
    tokenizer's EOS, or the first id that is not padding; None for every other family (the tail stays padding)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return None
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    return eos if eos is not None and eos != pad else next(i for i in range(len(tokenizer)) if i != pad)
