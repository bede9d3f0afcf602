"""Attention kernels from the Hugging Face hub (`attn_implementation: owner/repo`, e.g.
`kernels-community/vllm-flash-attn3`). transformers downloads them with the `kernels` package when the model loads
and registers them as an attention function: a kernel that exposes flash attention's varlen entry point is called
through transformers' own flash-attention wrapper, which reads packed documents' boundaries from the restarting
position ids, exactly like `flash_attention_2`. Other kernels get their own call convention, so packing with them is
refused once the kernel is known."""

from __future__ import annotations

import importlib.util
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.model import is_hub_kernel
from hellbender.errors import ConfigError, EnvironmentProblem


def kernels_installed() -> bool:
    return importlib.util.find_spec("kernels") is not None


def require_kernels_package(cfg: HellbenderConfig) -> None:
    """Checked where the model loads: the machine that validated a config need not be the one that trains it."""
    if is_hub_kernel(cfg.attn_implementation) and not kernels_installed():
        raise EnvironmentProblem(
            f"`attn_implementation: {cfg.attn_implementation}` is an attention kernel from the Hugging Face hub, "
            "which needs the `kernels` package, which is not installed. Install it with `pip install kernels` (it "
            "downloads the kernel from the hub, or takes it from the hub cache offline), or choose a built-in "
            "backend such as `flash_attention_2` or `sdpa`."
        )


def packs_like_flash_attention(attn_implementation: str) -> bool:
    """Whether the registered attention function is transformers' flash-attention wrapper (position-id packing)."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(attn_implementation) is flash_attention_forward


def check_hub_kernel_packing(cfg: HellbenderConfig, model: Any) -> None:
    """After loading: packed rows need a kernel that keeps their documents apart."""
    name = cfg.attn_implementation
    if not is_hub_kernel(name) or not (cfg.sample_packing or cfg.eval_sample_packing):
        return
    if not packs_like_flash_attention(name):
        raise ConfigError(
            f"`attn_implementation: {name}` is a hub kernel that transformers does not call as flash attention (it "
            "has no `flash_attn_varlen_func`, or `:function` names another entry point), so packed documents could "
            "attend to each other. Set `sample_packing: false`, or use a flash-attention kernel such as "
            "`kernels-community/vllm-flash-attn3` or `kernels-community/flash-attn3`."
        )
