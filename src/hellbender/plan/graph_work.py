"""What one traced graph of a compiled layer (AOTAutograd's forward or backward, aten ops on the meta device) asks of
the GPU, counted the way inductor runs it: its matmuls stay library calls; the elementwise and reduction ops between
them are fused, so each fused stretch reads the tensors it takes from memory once and writes only what leaves it
(for a matmul, for attention, or as the graph's output, saved tensors included). Views cost nothing.

Counts are per token of the traced row, split into the part that grows with the tokens (activations) and the part
that does not (weights), so one trace prices any micro-batch. A tensor grows with the tokens when one of its
dimensions is the traced token count: the trace picks a count no weight has as a dimension (`token_count`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

# Ops that only re-describe their input's memory.
VIEWS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "as_strided", "lift_fresh_copy",
}  # fmt: skip
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


@dataclass(frozen=True)
class Bytes:
    """Bytes that grow with the tokens (per token) and bytes that do not."""

    per_token: float = 0.0
    fixed: float = 0.0

    def at(self, tokens: float) -> float:
        return self.per_token * tokens + self.fixed

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.per_token + other.per_token, self.fixed + other.fixed)


@dataclass(frozen=True)
class Matmul:
    flops_per_token: float
    traffic: Bytes  # its two operands read and its output written


@dataclass(frozen=True)
class GraphWork:
    """One graph's matmuls, its fused elementwise traffic and the kernels it launches (matmuls, attention, and one
    per tensor a fused stretch writes: inductor's kernels write one or a few each)."""

    matmuls: tuple[Matmul, ...] = ()
    fused: Bytes = field(default_factory=Bytes)
    kernels: int = 0


def token_count(layer: torch.nn.Module, wanted: int) -> int:
    """The smallest multiple of 8 from `wanted` up that no parameter of `layer` has as a dimension, so a tensor with
    that dimension is an activation."""
    dims = {d for p in layer.parameters() for d in p.shape}
    tokens = -(-wanted // 8) * 8
    while tokens in dims:
        tokens += 8
    return tokens


def graph_work(graph: torch.fx.Graph, tokens: int, opaque: set[str]) -> GraphWork:
    """`graph`'s work at `tokens` traced tokens; ops whose name is in `opaque` (attention) are priced elsewhere and
    count here as one kernel each, their inputs and outputs as memory."""

    def kind(node: torch.fx.Node) -> str:
        if node.op in ("placeholder", "get_attr"):
            return "memory"
        if node.op == "output":
            return "output"
        if node.target is operator.getitem:
            return "view"
        name = _op_name(node)
        if name in VIEWS:
            return "view"
        if name in MATMULS:
            return "matmul"
        if name in opaque:
            return "opaque"
        return "fused"

    kinds = {node: kind(node) for node in graph.nodes}

    def base(node: Any) -> torch.fx.Node | None:
        """The node whose memory `node` views."""
        while isinstance(node, torch.fx.Node) and kinds[node] == "view":
            node = next((a for a in node.all_input_nodes), None)
        return node if isinstance(node, torch.fx.Node) else None

    def leaves_fusion(node: torch.fx.Node) -> bool:
        """Whether a fused node's result is read by something that is not fused (through views)."""
        stack = list(node.users)
        while stack:
            user = stack.pop()
            if kinds[user] == "view":
                stack.extend(user.users)
            elif kinds[user] != "fused":
                return True
        return False

    def traffic(node: torch.fx.Node) -> Bytes:
        total = Bytes()
        for value in _tensors(node.meta.get("val")):
            size = value.numel() * value.element_size()
            total += Bytes(size / tokens, 0.0) if tokens in value.shape else Bytes(0.0, size)
        return total

    matmuls, fused, kernels, read = [], Bytes(), 0, set()
    for node in graph.nodes:
        k = kinds[node]
        if k == "matmul":
            a, b = (base(arg) for arg in _matmul_operands(node))
            moved = (
                traffic(node) + (traffic(a) if a is not None else Bytes()) + (traffic(b) if b is not None else Bytes())
            )
            matmuls.append(Matmul(_matmul_flops(node) / tokens, moved))
            kernels += 1
        elif k == "opaque":
            kernels += 1
        elif k == "fused":
            for source in {base(arg) for arg in node.all_input_nodes}:
                if source is not None and kinds[source] != "fused" and source not in read:
                    read.add(source)
                    fused += traffic(source)
            if leaves_fusion(node):
                fused += traffic(node)
                kernels += 1
    return GraphWork(tuple(matmuls), fused, kernels)


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _tensors(item)]
    return []


def _matmul_operands(node: torch.fx.Node) -> tuple[Any, Any]:
    """The two multiplied operands (addmm / baddbmm take the added term first)."""
    args = node.args[1:3] if _op_name(node) in ("addmm", "baddbmm") else node.args[:2]
    return args[0], args[1]


def _matmul_flops(node: torch.fx.Node) -> float:
    a, b = (arg.meta["val"] for arg in _matmul_operands(node))
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
