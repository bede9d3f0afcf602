"""The attention a model is loaded with when the config leaves `attn_implementation` to hellbender.

hellbender's default is `sdpa`. Some architectures have no SDPA path in transformers (gpt-oss's attention sinks,
BLOOM's ALiBi, GPT-Neo, ...), and transformers refuses `attn_implementation="sdpa"` for them while building the
model, before any weight is read. When the user did not choose the attention, hellbender then loads the model with
`eager` and says so in one line; when the user asked for `sdpa` (`attn_implementation: sdpa` or `sdp_attention:
true`), the refusal stands, naming the model."""

from __future__ import annotations

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError

# The start of transformers' refusal (`PreTrainedModel._sdpa_can_dispatch` and its flex/flash siblings).
NOT_SUPPORTED = "does not support an attention implementation"


def attention_was_chosen(cfg: HellbenderConfig) -> bool:
    return "attn_implementation" in cfg.model_fields_set or cfg.sdp_attention or cfg.flash_attention


def falls_back_to_eager(cfg: HellbenderConfig, exc: ValueError) -> bool:
    """Whether transformers' refusal `exc` is of the default `sdpa`, which hellbender replaces by `eager`."""
    return NOT_SUPPORTED in str(exc) and cfg.attn_implementation == "sdpa" and not attention_was_chosen(cfg)


def eager_notice(exc: ValueError) -> str:
    return (
        f"{_model_class(exc)} has no SDPA attention in transformers, so hellbender loads it with "
        "`attn_implementation: eager` (the default `sdpa` was not chosen in the config); eager attention holds the "
        "[batch, heads, seq, seq] scores in memory."
    )


def refusal(cfg: HellbenderConfig, exc: ValueError) -> ConfigError:
    """The paragraph for an attention backend transformers refuses for this model."""
    return ConfigError(
        f"`attn_implementation: {cfg.attn_implementation}` cannot be used with this model: {_model_class(exc)} does not "
        "support it in transformers. Choose another backend: `eager` (every architecture has it), or flash attention "
        "(`flash_attention_2`, `flash_attention_3`, or a hub kernel such as `kernels-community/vllm-flash-attn3`) "
        "where the model supports it; or remove `attn_implementation` to let hellbender choose."
    )


def _model_class(exc: ValueError) -> str:
    return str(exc).split(f" {NOT_SUPPORTED}")[0]
