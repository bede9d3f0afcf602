"""One process's share of a batch under context parallelism over packed rows (`models/split_attention.py`).

Every process of a context-parallel group receives the same batch; each keeps the tokens of its two chunks of every
row, with their global position ids (so rotary positions stay those of the whole row) and the next token of each
position shifted before the cut (the token after a chunk's last one lies in another process's chunk).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from hellbender.data.collator import REAL_TOKENS_KEY
from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.models.split_attention import RowSplit, document_spans

# The batch's tensors laid out [row, token]: each is cut to the process's tokens.
TOKEN_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def split_rows(inputs: dict[str, Any], group: Any, size: int, rank: int) -> tuple[dict[str, Any], RowSplit]:
    """This process's share of `inputs` (a padded or packed text batch) and the split its attention reads. A padded
    row is one document: its padding comes after its tokens, so no real token attends to it."""
    labels = inputs["labels"]
    rows, length = labels.shape
    if length % (2 * size):
        raise ValueError(f"a row of {length} tokens cannot be cut into 2 x {size} equal chunks (the collator pads)")
    if "position_ids" in inputs:
        documents = document_spans(inputs["position_ids"])
    else:
        documents = tuple(((0, length),) for _ in range(rows))
    split = RowSplit(group=group, size=size, rank=rank, length=length, documents=documents)
    index = split.local_index(labels.device)
    shares = {key: inputs[key].index_select(1, index) for key in TOKEN_KEYS if inputs.get(key) is not None}
    shares["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].index_select(1, index)
    if (real := inputs.get(REAL_TOKENS_KEY)) is not None:  # each row's real tokens come first: count those held
        shares[REAL_TOKENS_KEY] = (index[None, :] < real.to(index.device)[:, None]).sum(dim=1)
    return {**inputs, **shares}, split
