"""Bytes of optimizer state per trainable parameter tensor, by optimizer name (transformers' names).

The rules follow what each optimizer allocates at its first step: torch's AdamW keeps `exp_avg` and `exp_avg_sq` in
the parameter's dtype plus a float32 `step`; bitsandbytes' 8-bit optimizers keep uint8 states with one float32 scale
per block of 256 values, and 32-bit states for tensors under 4,096 values; torch's SGD without momentum keeps
nothing. An unknown name is planned as AdamW with float32 states (said in the report)."""

from __future__ import annotations

from dataclasses import dataclass

from hellbender.plan.model_facts import Parameter

_BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer states: one float32 absmax per 256 values
_BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit states for tensors smaller than this


@dataclass(frozen=True)
class OptimizerRule:
    states: int  # state tensors of the parameter's size
    bits: int  # 8 for bitsandbytes' 8-bit states, 0: the parameter's own dtype, 32: float32
    step_bytes: int  # a per-tensor step counter
    known: bool = True
    paged: bool = False  # bitsandbytes' paged states can move to host memory under pressure


def optimizer_rule(name: str) -> OptimizerRule:
    n = name.lower()
    paged = n.startswith("paged_")
    if n in ("sgd",):
        return OptimizerRule(states=0, bits=0, step_bytes=0)
    if n in ("adagrad", "rmsprop"):
        return OptimizerRule(states=1, bits=0, step_bytes=4)
    if "8bit" in n:
        states = 1 if "lion" in n or "rmsprop" in n else 3 if "ademamix" in n else 2
        return OptimizerRule(states=states, bits=8, step_bytes=0, paged=paged)
    if "lion" in n:
        return OptimizerRule(states=1, bits=32 if "32bit" in n else 0, step_bytes=0, paged=paged)
    if "32bit" in n:
        return OptimizerRule(states=3 if "ademamix" in n else 2, bits=32, step_bytes=0, paged=paged)
    if n.startswith(("adamw_torch", "adamw_hf", "adam")) or n in ("adamw",):
        return OptimizerRule(states=2, bits=0, step_bytes=4)
    return OptimizerRule(states=2, bits=32, step_bytes=4, known=False)


def state_bytes(rule: OptimizerRule, parameter: Parameter) -> int:
    """Optimizer state bytes of one trainable parameter tensor."""
    n = parameter.numel
    if rule.bits == 8 and n >= _BNB_MIN_8BIT:
        blocks = -(-n // _BNB_BLOCK)
        per_state = n + 4 * blocks
    elif rule.bits in (8, 32):
        per_state = 4 * n
    else:
        per_state = parameter.nbytes
    return rule.states * per_state + rule.step_bytes
