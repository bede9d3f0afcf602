"""LoRA under quantization-aware training (`qat:` with `adapter: lora`): each adapted linear layer computes with the
fake-quantized *merged* weight,

    y = fq_act(x) · fq_w(W + scaling·B·A)ᵀ + bias,

the weight `hellbender quantize` stores after merging the adapter (as `merge-lora` does) and quantizing. Gradients
pass straight through the rounding to A and B; W stays frozen. A layer that torchao's QAT fake-quantizes W of alone,
with B·A added beside it (fq(W)·x + B·A·x), would train against a rounding the stored model never applies.

How it is built, through the libraries' public APIs: torchao's QAT first swaps the model's linear layers for its
`FakeQuantizedLinear` (models/qat.py, as for full fine-tuning), then PEFT wraps them with LoRA, and PEFT's custom
LoRA layer dispatch (`LoraConfig._register_custom_module`, documented as experimental in PEFT's "custom models"
guide) maps a `FakeQuantizedLinear` to `FakeQuantizedLoraLinear`, a `lora.Linear` whose forward applies the base
layer's own torchao fake quantizers to the merged weight. The layer keeps PEFT's names (`base_layer`, `lora_A`,
`lora_B`), so the saved adapter is an ordinary PEFT adapter; `QatLoraConfig` also writes the scheme beside it
(`hellbender_qat.json`), where `hellbender quantize` finds it.

With fake quantization switched off (`fake_quant_after_n_steps`), the layer runs PEFT's own LoRA forward."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear

from hellbender.config.quantization import QatSettings
from hellbender.errors import ConfigError
from hellbender.models.qat import ADAPTER_RECORD_FILE


class FakeQuantizedLoraLinear(LoraLinear):
    """PEFT's LoRA linear layer over a torchao `FakeQuantizedLinear`, computing with the fake-quantized merged weight
    while the base layer's fake quantization is on."""

    def __init__(self, base_layer: Any, adapter_name: str, **kwargs: Any) -> None:
        if kwargs.get("parameter_name") is not None:  # PEFT's ParamWrapper route (`target_parameters`)
            raise ConfigError(
                f"`qat:` with LoRA on the weight of a fake-quantized linear layer as a parameter "
                f"(`{kwargs['parameter_name']}`, PEFT's `target_parameters`): only LoRA on the layer itself trains "
                "against the quantized merged weight. Name the layer in `lora_target_modules` instead."
            )
        super().__init__(base_layer, adapter_name, **kwargs)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        base = self.get_base_layer()
        quantizer = base.weight_fake_quantizer
        if self.disable_adapters or self.merged or quantizer is None or not quantizer.enabled:
            # Fake quantization off: PEFT's own forward (the base layer then computes x·Wᵀ + bias exactly). Adapters
            # disabled or merged: the base layer alone, fake-quantizing its (merged) weight itself.
            return super().forward(x, *args, **kwargs)
        if kwargs.get("adapter_names") is not None:
            raise ConfigError(
                "Mixed-adapter batches (`adapter_names`) are not supported under `qat:`: each row would need its own "
                "merged weight fake-quantized. Run one adapter at a time."
            )
        self._check_forward_args(x, *args, **kwargs)
        weight = base.weight
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            self._check_mergeable(name)
            # As PEFT's merge computes it (`merge(safe_merge=True)`): the update rounded to the weight's dtype, then
            # added, so the weight fake-quantized here is bit for bit the merged weight `quantize` stores.
            weight = weight + self.get_delta_weight(name).to(weight.dtype)
        if base.activation_fake_quantizer is not None:
            x = base.activation_fake_quantizer(x)
        return F.linear(x, quantizer(weight), base.bias)

    def _check_mergeable(self, name: str) -> None:
        """What the merged weight cannot express (config checks refuse these first, by key)."""
        if not isinstance(self.lora_dropout[name], torch.nn.Identity):
            raise ConfigError(
                "`lora_dropout` with `qat:`: dropout drops entries of the LoRA branch's input only, which a merged "
                "weight cannot express. Set `lora_dropout: 0`."
            )
        if name in self.lora_variant or self.lora_bias.get(name):
            raise ConfigError(
                f"`qat:` with a LoRA variant ({type(self.lora_variant.get(name)).__name__}) or a LoRA bias: only plain "
                "LoRA trains against the quantized merged weight here. Remove `peft_use_dora`."
            )


@dataclass
class QatLoraConfig(LoraConfig):
    """PEFT's LoraConfig that also saves the QAT scheme beside adapter_config.json (`hellbender_qat.json`) whenever
    PEFT saves the adapter: in every checkpoint and in the final output. adapter_config.json itself stays what plain
    LoraConfig writes."""

    qat_scheme: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        settings = super().to_dict()
        settings.pop("qat_scheme", None)
        return settings

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        super().save_pretrained(save_directory, **kwargs)
        with open(os.path.join(save_directory, ADAPTER_RECORD_FILE), "w") as f:
            json.dump(self.qat_scheme, f, indent=1)


def qat_lora_config(qat: QatSettings, **settings: Any) -> LoraConfig:
    """PEFT's LoRA config for training under `qat`: LoRA on a fake-quantized linear layer computes with the
    fake-quantized merged weight (`FakeQuantizedLoraLinear`)."""
    from torchao.quantization.qat import FakeQuantizedLinear

    config = QatLoraConfig(**settings, qat_scheme=qat.settings())
    config._register_custom_module({FakeQuantizedLinear: FakeQuantizedLoraLinear})
    return config


def check_adapted_under_qat(model: Any) -> int:
    """Every LoRA layer PEFT put over a fake-quantized module must be a `FakeQuantizedLoraLinear` (another kind, a
    LoRA embedding say, would add its update beside the fake-quantized weight); returns how many there are."""
    from peft.tuners.lora import LoraLayer

    from hellbender.models.qat import is_fake_quantized

    found = 0
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, FakeQuantizedLoraLinear):
            found += 1
        elif is_fake_quantized(module.get_base_layer()):
            raise ConfigError(
                f"`qat:` with LoRA on `{name}` ({type(module.get_base_layer()).__name__}): this kind of layer cannot "
                "train against its quantized merged weight (only linear layers can, with integer or float8 schemes). "
                "Leave it out of `lora_target_modules`, or remove `qat.quantize_embedding`."
            )
    return found
