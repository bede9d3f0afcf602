"""Attention over rows split across a context-parallel group, packed documents kept apart.

PyTorch's ring attention, which `context_parallel_size` runs for padded rows, computes plain causal attention over
each whole row: the documents of a packed row would read each other. For packed rows hellbender splits the rows itself,
in the ring's layout (each row cut into 2 x N equal chunks; process r of a group of N holds chunks r and 2N-1-r, so
every process has the same share of causal work), and registers this attention with transformers: each process
gathers the keys and values of its group's whole rows and attends from its own queries to the keys of their own
document that precede them. Positions stay global (the position ids are cut with the tokens), and the gradients of
the gathered keys and values flow back to the processes that computed them.

A process holds the whole row's keys and values of a layer while that layer runs, and keeps them for its backward:
under activation checkpointing one layer's at a time, without it every layer's. Under grouped-query attention they are
a fraction of the layer's hidden states (a quarter each for Llama-3-8B's 8 of 32 heads, keys and values together half),
while the activations, logits and loss stay 1/N of the row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

SPLIT_ATTENTION = "hellbender_split_documents"

# Keyword arguments some families pass to their attention function that this attention cannot honour.
UNSUPPORTED_ARGUMENTS = ("sliding_window", "softcap", "s_aux", "position_bias")


@dataclass(frozen=True)
class RowSplit:
    """Where this process's tokens sit in its group's rows: `documents[b]` are row b's documents as `(start, end)`
    over the whole row of `length` tokens (a multiple of 2 x `size`); this process is `rank` of `size`."""

    group: Any  # the context-parallel process group
    size: int
    rank: int
    length: int
    documents: tuple[tuple[tuple[int, int], ...], ...]
    # What every layer of the step asks for again, kept from its first computation: the gathered order per device
    # (copying it to the GPU at every layer would make the host wait for the GPU each time) and the pieces per row.
    _kept: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.size)

    def chunk_spans(self, rank: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two chunks of the row a process holds, in the order it holds them."""
        rank = self.rank if rank is None else rank
        c, last = self.chunk, 2 * self.size - 1
        return (rank * c, (rank + 1) * c), ((last - rank) * c, (last - rank + 1) * c)

    def local_index(self, device: torch.device | None = None) -> torch.Tensor:
        """The whole row's positions of this process's tokens, in the order it holds them."""
        return torch.cat([torch.arange(start, end, device=device) for start, end in self.chunk_spans()])

    def gathered_order(self, device: torch.device | None = None) -> torch.Tensor:
        """For each position of the whole row, where it lies in the group's tokens gathered rank after rank."""
        key = ("order", str(device))
        if key not in self._kept:
            held = torch.cat(
                [torch.arange(start, end) for rank in range(self.size) for start, end in self.chunk_spans(rank)]
            )
            self._kept[key] = torch.argsort(held).to(device)
        return self._kept[key]

    def pieces(self, row: int) -> list[tuple[int, int, int, int]]:
        """Row `row`'s attention as `(query start, query end, key start, key end)`: the queries in this process's
        order, the keys over the whole row. Each piece is one document's queries within one chunk; they attend to
        the document's keys up to the last query (causal, aligned at the end)."""
        key = ("pieces", row)
        if key not in self._kept:
            pieces, held = [], 0
            for chunk_start, chunk_end in self.chunk_spans():
                for doc_start, doc_end in self.documents[row]:
                    start, end = max(chunk_start, doc_start), min(chunk_end, doc_end)
                    if start < end:
                        pieces.append((held + start - chunk_start, held + end - chunk_start, doc_start, end))
                held += chunk_end - chunk_start
            self._kept[key] = pieces
        return list(self._kept[key])


# The split of the step being run. A plain module attribute, not a context variable: activation checkpointing
# recomputes the layers during backward, which on a GPU runs in autograd's own threads.
_current: RowSplit | None = None


@contextlib.contextmanager
def splitting_rows(split: RowSplit) -> Iterator[None]:
    """The split the attention layers read while the model runs forward and backward (recomputing under
    checkpointing)."""
    global _current
    previous, _current = _current, split
    try:
        yield
    finally:
        _current = previous


def document_spans(position_ids: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each row's documents from its position ids, which restart where a document starts (the padding after the
    last document is a block of its own, as the collator writes it)."""
    spans = []
    for row in position_ids.tolist():
        starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1] + 1]
        spans.append(tuple(zip(starts, [*starts[1:], len(row)], strict=True)))
    return tuple(spans)


class _GatherSequence(torch.autograd.Function):
    """All-gathers a [batch, heads, tokens, dim] tensor along its tokens over the group, rank after rank; its
    gradient is summed over the group and each process keeps its own tokens' part."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.tokens = group, rank, local.shape[2]
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(2, ctx.rank * ctx.tokens, ctx.tokens), None, None, None


def gather_row(local: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """The group's whole rows of `local` (this process's tokens), in row order."""
    gathered = _GatherSequence.apply(local, split.group, split.size, split.rank)
    return gathered.index_select(2, split.gathered_order(local.device))


def split_documents_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query` [batch, heads, local tokens, dim], `key`/`value` [batch, key
    heads, local tokens, dim]; returns [batch, local tokens, heads, dim]. The mask is not read: the documents come
    from the split (the model's own masks would cover this process's tokens only)."""
    split = _current
    if split is None:
        raise RuntimeError(f"{SPLIT_ATTENTION} attention ran outside `splitting_rows`: no row split is known")
    unsupported = [name for name in UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(
            f"{type(module).__name__} calls attention with {', '.join(unsupported)}, which context parallelism over "
            "packed rows does not compute. Set `sample_packing: false` to split padded rows with PyTorch's ring "
            "attention, or remove `context_parallel_size`."
        )
    key, value = gather_row(key, split), gather_row(value, split)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dropout = dropout if module.training else 0.0
    rows = []
    for row in range(query.shape[0]):
        outputs = [
            F.scaled_dot_product_attention(
                query[row : row + 1, :, q_start:q_end],
                key[row : row + 1, :, k_start:k_end],
                value[row : row + 1, :, k_start:k_end],
                attn_mask=causal_lower_right(q_end - q_start, k_end - k_start),
                dropout_p=dropout,
                scale=scaling,
            )
            for q_start, q_end, k_start, k_end in split.pieces(row)
        ]
        rows.append(torch.cat(outputs, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask builder registered beside the attention: no mask, the attention reads the documents itself."""
    return None


def use_split_attention(model: Any) -> None:
    """Switch a model loaded with SDPA to the split attention (transformers' registered-attention route)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SPLIT_ATTENTION, split_documents_attention)
    AttentionMaskInterface.register(SPLIT_ATTENTION, no_mask)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(SPLIT_ATTENTION)
