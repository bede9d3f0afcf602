"""The torchao side of a `qat:` / `quantization:` scheme: the torchao config that quantizes with it (whether this
machine can run it is `config/quantization_machine.py`). Quantization-aware training and `hellbender quantize` build
their configs here, so the numbers trained against are the numbers stored."""

from __future__ import annotations

from typing import Any

from hellbender.config.quantization import QuantizationScheme


def linear_config(scheme: QuantizationScheme) -> Any:
    """torchao's config that quantizes a linear layer with `scheme` (the base of its QAT config too)."""
    import torch
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8DynamicActivationInt4WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    group = scheme.effective_group_size
    pair = (scheme.weight_dtype, scheme.activation_dtype)
    if pair == ("int8", None):
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(group))
    if pair == ("int4", None):
        return Int4WeightOnlyConfig(group_size=group)
    if pair == ("int4", "int8"):
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group))
    if pair == ("int4", "float8"):
        return Float8DynamicActivationInt4WeightConfig()
    if pair == ("float8", "float8"):
        return Float8DynamicActivationFloat8WeightConfig()
    from torchao.prototype.mx_formats import (
        MXDynamicActivationMXWeightConfig,
        NVFP4DynamicActivationNVFP4WeightConfig,
        NVFP4WeightOnlyConfig,
    )

    if pair == ("nvfp4", None):
        return NVFP4WeightOnlyConfig()
    if pair == ("nvfp4", "nvfp4"):
        return NVFP4DynamicActivationNVFP4WeightConfig()
    return MXDynamicActivationMXWeightConfig(
        activation_dtype=torch.float4_e2m1fn_x2, weight_dtype=torch.float4_e2m1fn_x2, block_size=group
    )


def embedding_config(scheme: QuantizationScheme) -> Any:
    """torchao's weight-only config for the input embedding (`quantize_embedding`): embeddings have no activation to
    quantize, and torchao quantizes an embedding table only through its integer weight-only config."""
    import torch
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    bits = {"int4": torch.int4, "int8": torch.int8}[scheme.weight_dtype]
    return IntxWeightOnlyConfig(weight_dtype=bits, granularity=PerGroup(scheme.effective_group_size))
