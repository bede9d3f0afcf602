"""What a compiled decoder layer keeps for backward, asked of the compiler itself.

`torch_compile` hands each layer's forward and backward to AOTAutograd, whose partitioner decides which tensors the
forward saves and which the backward recomputes (cheap elementwise work first, more of it under
`activation_memory_budget`). That choice is not the eager layer's, so the per-op count of `activations.py` does not
hold. Here one decoder layer of the planned meta model is traced with AOTAutograd and the same partitioner, on the
meta device (no memory, no GPU, about a second), and what the forward graph hands to the backward is summed.

On the meta device SDPA would fall back to its math form and save the attention probabilities, which no GPU kernel
does; the traced layer runs an opaque attention op instead that saves what the flash-style kernels save (queries,
keys, values, output, log-sum-exp). Traced this way, an 8B Llama layer with LoRA r16 at 4,096 tokens keeps 0.533 GiB
at the default budget and 0.266 / 0.188 GiB at 0.5 / 0.4 where an H200 measured 0.535, 0.259 and 0.188
(`bench/activation_memory_budget.py`); at 0.7-0.9 it keeps 0.361 against 0.329 measured (docs/plan.md).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from hellbender.config import HellbenderConfig
from hellbender.plan.graph_work import GraphWork, graph_work, token_count

logger = logging.getLogger(__name__)

ATTENTION_NAME = "hellbender_plan_attention"


@torch.library.custom_op("hellbender_plan::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("traced on the meta device only")


@_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("hellbender_plan::attention_backward", mutates_args=())
def _attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("traced on the meta device only")


@_attention_backward.register_fake
def _(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_backward(ctx: Any, inputs: tuple[torch.Tensor, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx: Any, grad: torch.Tensor, _lse_grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _attention_backward(grad, *ctx.saved_tensors)


_attention.register_autograd(_backward, setup_context=_save_for_backward)


def _planned_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: [batch, heads, tokens, head dim] in, [batch, tokens, heads, dim] out."""
    out, _ = _attention(query, key, value)
    return out.transpose(1, 2).contiguous(), None


@dataclass(frozen=True)
class CompiledLayer:
    """One compiled decoder layer as traced: what its forward keeps for backward, and what its forward and backward
    graphs ask of the GPU (graph_work.py; the backward's recomputation under the budget included)."""

    saved_bytes_per_token: float
    forward: GraphWork
    backward: GraphWork


OPAQUE = {"attention", "attention_backward"}  # priced by the attention kernels' rates (kernel_costs.py)


def trace_compiled_layer(cfg: HellbenderConfig, model: Any, layer: Any, tokens: int) -> CompiledLayer | None:
    """`layer` (a decoder layer of `model`, the planned meta model) compiled with the config's
    `activation_memory_budget`, traced in one row of about `tokens` tokens (`graph_work.token_count`); None where the
    layer cannot be traced this way (its call is not the Llama-shaped one, or dynamo breaks the graph)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from transformers import AttentionInterface

    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    if rotary is None or not hasattr(getattr(layer, "self_attn", None), "config"):
        return None
    # Training runs the layer under autocast in the base weights' dtype: a float32 adapter's matmuls run in it too.
    # Autocast does not act on the meta device, so the traced copy holds every weight in that dtype instead.
    dtype = min((p.dtype for p in layer.parameters() if p.is_floating_point()), key=lambda d: d.itemsize)
    tokens = token_count(layer, tokens)
    layer = copy.deepcopy(layer).to(dtype)  # its own config too, whose attention is the planned op
    AttentionInterface.register(ATTENTION_NAME, _planned_attention)
    layer.self_attn.config._attn_implementation = ATTENTION_NAME
    hidden = torch.empty(1, tokens, model.config.get_text_config().hidden_size, device="meta", dtype=dtype,
                         requires_grad=True)  # fmt: skip
    # The model computes the rotary embedding once, outside the layers hellbender compiles.
    cos, sin = rotary(hidden, torch.arange(tokens, device="meta")[None])
    saved: list[int] = []
    work: dict[str, GraphWork] = {}

    def backend(graph: Any, inputs: list[Any]) -> Any:
        def forward_compiler(forward: Any, _inputs: Any) -> Any:
            # The forward's outputs: the layer's own, then what it saves for backward (graph inputs, the weights
            # among them, are not new memory).
            outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
            kept = {n for n in outputs[1:] if isinstance(n, torch.fx.Node) and n.op != "placeholder"}
            values = [n.meta.get("val") for n in kept]
            saved.append(sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)))
            work["forward"] = graph_work(forward.graph, tokens, OPAQUE)
            return make_boxed_func(forward.forward)

        def backward_compiler(backward: Any, _inputs: Any) -> Any:
            work["backward"] = graph_work(backward.graph, tokens, OPAQUE)
            return make_boxed_func(backward.forward)

        return aot_module_simplified(
            graph,
            inputs,
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            partition_fn=min_cut_rematerialization_partition,
        )

    def call(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return layer(hidden, position_embeddings=(cos, sin), attention_mask=None)

    budget = cfg.activation_memory_budget if cfg.activation_memory_budget is not None else 1.0
    torch._dynamo.reset()
    try:
        # The backward graph is partitioned with the forward; lowering it now, not at the first backward, hands it
        # to the backward compiler here.
        with functorch_config.patch(activation_memory_budget=budget, force_non_lazy_backward_lowering=True):
            torch.compile(call, backend=backend, fullgraph=True)(hidden, cos, sin)
    except Exception as exc:  # a family whose layer does not trace as one graph: planned as uncompiled
        logger.debug("compiled layer not traced: %s", exc)
        return None
    finally:
        torch._dynamo.reset()
    if len(saved) != 1 or len(work) != 2:
        return None
    return CompiledLayer(saved[0] / tokens, work["forward"], work["backward"])
