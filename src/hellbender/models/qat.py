"""Quantization-aware training (`qat:`): torchao swaps each linear layer for one that fake-quantizes (rounds to the
scheme's numbers and back) its weight, and with `activation_dtype` its input, in the forward pass; gradients pass
straight through the rounding, so the full-precision weights learn to sit where quantization costs little.

The swapped layers keep their parameter names, so every save (checkpoints, the final model) is the plain unquantized
model. The scheme is recorded in the model's config.json under `hellbender_qat`, where `hellbender quantize` finds
it. `lm_head` stays unquantized unless `quantize_embedding`, as transformers' TorchAoConfig leaves it, so the
quantized model computes what training fake-quantized. With a LoRA adapter the layers are swapped before PEFT wraps
them, and LoRA on a swapped layer fake-quantizes the merged weight (models/qat_lora.py); the adapter's saves record
the scheme in `hellbender_qat.json` beside adapter_config.json."""

from __future__ import annotations

import logging
from typing import Any

from hellbender.config.quantization import QatSettings, QuantizationScheme
from hellbender.errors import ConfigError
from hellbender.models.torchao_schemes import embedding_config, linear_config

logger = logging.getLogger("hellbender")
RECORD_KEY = "hellbender_qat"  # in config.json: the QAT scheme the weights were trained against
ADAPTER_RECORD_FILE = "hellbender_qat.json"  # beside adapter_config.json: the scheme a LoRA adapter trained against


def linear_filter(model: Any, quantize_embedding: bool) -> Any:
    """torchao's `filter_fn` for the linear layers a scheme quantizes: all of them but the output projection,
    unless the embeddings are quantized too."""
    import torch

    output = model.get_output_embeddings()

    def keep(module: Any, _name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and (quantize_embedding or module is not output)

    return keep


def check_fits(model: Any, scheme: QuantizationScheme, key: str) -> None:
    """Refuse, by key, a scheme the model's shapes or weight tying cannot take (torchao would fail mid-way)."""
    import torch

    group = scheme.effective_group_size
    quantized = linear_filter(model, scheme.quantize_embedding)
    if group:
        for name, module in model.named_modules():
            if quantized(module, name) and module.in_features % group:
                raise ConfigError(
                    f"`{key}.group_size: {group}` does not divide the input size {module.in_features} of `{name}`: "
                    f"each row of a weight is quantized in groups of that many. Choose a group size that divides "
                    "the input size of every linear layer (e.g. 32 or a smaller power of two)."
                )
    if scheme.quantize_embedding:
        inputs, output = model.get_input_embeddings(), model.get_output_embeddings()
        if output is not None and output.weight is inputs.weight:
            raise ConfigError(
                f"`{key}.quantize_embedding: true` with a model whose input embedding and `lm_head` share one weight "
                "(`tie_word_embeddings`): the one matrix would be quantized two ways. Remove `quantize_embedding`."
            )
        if not isinstance(inputs, torch.nn.Embedding):
            raise ConfigError(
                f"`{key}.quantize_embedding: true`, and this model's input embedding is a "
                f"`{type(inputs).__name__}`, not the plain embedding table torchao quantizes. Remove it."
            )


def prepare_for_qat(model: Any, qat: QatSettings) -> int:
    """Swap the model's linear layers (and with `quantize_embedding` its input embedding) for fake-quantized ones;
    record the scheme in the model's config. Returns how many modules were swapped."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    check_fits(model, qat, "qat")
    quantize_(
        model, QATConfig(linear_config(qat), step="prepare"), filter_fn=linear_filter(model, qat.quantize_embedding)
    )
    if qat.quantize_embedding:
        embedding = model.get_input_embeddings()
        quantize_(
            model, QATConfig(embedding_config(qat), step="prepare"), filter_fn=lambda module, _: module is embedding
        )
    if qat.weight_dtype == "float8" or qat.activation_dtype == "float8":
        from hellbender.models.qat_float8 import pass_float8_gradients_straight

        pass_float8_gradients_straight(model)  # torchao's own backward rounds the gradients to float8
    swapped = sum(is_fake_quantized(m) for m in model.modules())
    setattr(model.config, RECORD_KEY, qat.settings())
    logger.info("qat: %d layers fake-quantized (%s)", swapped, qat.describe())
    return swapped


def is_fake_quantized(module: Any) -> bool:
    """A layer torchao's QAT swapped in (its integer and float8 layers, and its prototype NVFP4 / MX ones)."""
    return "FakeQuantized" in type(module).__name__


def set_fake_quantization(model: Any, enabled: bool) -> int:
    """Switch the fake quantization of every fake-quantized layer on or off; returns how many were switched. Only
    torchao's integer and float8 layers have the switch (config checks refuse a delay for NVFP4 / MXFP4)."""
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    switched = 0
    for module in model.modules():
        if not isinstance(module, (FakeQuantizedLinear, FakeQuantizedEmbedding)):
            continue
        for quantizer in (module.weight_fake_quantizer, getattr(module, "activation_fake_quantizer", None)):
            if quantizer is not None:
                quantizer.enabled = enabled
        switched += 1
    return switched
