"""Config keys of torchao quantization (Axolotl's `qat:` and `quantization:` blocks): quantization-aware training
fake-quantizes the model's linear layers while it trains, and `hellbender quantize` then stores the trained model
with the same scheme; `quantization:` names the scheme of a post-training quantization (no QAT). The torchao side is
`models/torchao_schemes.py`; docs/quantization.md explains both."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hellbender.config.values import Int

QuantDtype = Literal["int4", "int8", "float8", "nvfp4", "mxfp4"]
# Axolotl reads these spellings of float8 as its one float8 format (e4m3).
_FLOAT8_SPELLINGS = ("fp8", "float8", "float8_e4m3fn")


def _dtype_name(value: Any) -> Any:
    return "float8" if value in _FLOAT8_SPELLINGS else value


Dtype = Annotated[QuantDtype, BeforeValidator(_dtype_name)]

_WEIGHT = (
    "The number format the linear layers' weights are quantized to: `int4`, `int8`, `float8` (also spelled `fp8` / "
    "`float8_e4m3fn`), `nvfp4` or `mxfp4`. With `activation_dtype` it names one scheme; docs/quantization.md lists the "
    "pairs and the machines each runs on."
)
_ACTIVATION = (
    "The number format the linear layers' inputs are quantized to as the model runs (dynamically: per token for "
    "`int8`, per tensor for `float8`, per block for `nvfp4` / `mxfp4`): `int8`, `float8`, `nvfp4` or `mxfp4`; unset: "
    "weight-only quantization."
)
_GROUP = (
    "How many consecutive weights of a row share one scale (per-group quantization of integer weights). It must "
    "divide the input size of every quantized layer; `nvfp4` takes only 16, `mxfp4` only 32, `float8` uses one scale "
    "per tensor (torchao's default for it) and refuses it."
)
_EMBEDDING = (
    "Also quantize the input embedding (weight-only, to `weight_dtype`: `int4` or `int8`) and the output projection "
    "`lm_head` (with the linear layers' scheme). Off: both stay in the training precision, as transformers' "
    "TorchAoConfig leaves them by default."
)


class QuantizationScheme(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_dtype: Dtype = Field("int8", description=_WEIGHT)
    activation_dtype: Dtype | None = Field(None, description=_ACTIVATION)
    group_size: Int = Field(32, gt=0, description=_GROUP)
    quantize_embedding: bool = Field(False, description=_EMBEDDING)

    def settings(self) -> dict[str, Any]:
        """The scheme alone (what `hellbender quantize` must repeat), as plain data."""
        return {
            "weight_dtype": self.weight_dtype,
            "activation_dtype": self.activation_dtype,
            "group_size": self.group_size,
            "quantize_embedding": self.quantize_embedding,
        }

    @property
    def effective_group_size(self) -> int | None:
        """The group size the scheme quantizes with: nvfp4 and mxfp4 have their own, float8 scales whole tensors."""
        if self.weight_dtype in _FIXED_GROUP:
            return _FIXED_GROUP[self.weight_dtype]
        return None if self.weight_dtype == "float8" else self.group_size

    def describe(self) -> str:
        activation = f"{self.activation_dtype} activations" if self.activation_dtype else "weight-only"
        group = f", groups of {self.effective_group_size}" if self.effective_group_size else ""
        return f"{self.weight_dtype} weights, {activation}{group}"


class QatSettings(QuantizationScheme):
    fake_quant_after_n_steps: Int | None = Field(
        None,
        ge=0,
        description="Train the first N optimizer steps without fake quantization and switch it on from step N (the "
        "model first adapts to the data in full precision). Unset: fake-quantized from the first step.",
    )


class QuantizationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    qat: QatSettings | None = Field(
        None,
        description="Quantization-aware training with torchao: every linear layer (but `lm_head`, unless "
        "`quantize_embedding`) computes with its weights (and, with `activation_dtype`, its inputs) rounded to the "
        "scheme's numbers in the forward pass, while the weights themselves train in full precision. The saved model "
        "is the unquantized trained model, with this block recorded in its config.json; `hellbender quantize CONFIG` "
        "then stores it quantized with the same scheme. With `adapter: lora`, each adapted layer computes with the "
        "fake-quantized merged weight W + B·A, which `quantize` merges and stores; the adapter's saves record this "
        "block in `hellbender_qat.json`. Needs `pip install 'hellbender[qat]'`. See docs/quantization.md.",
    )
    quantization: QuantizationScheme | None = Field(
        None,
        description="The scheme `hellbender quantize CONFIG` quantizes a model trained without `qat` with "
        "(post-training quantization with torchao). Changes nothing about training. See docs/quantization.md.",
    )

    @property
    def quantize_scheme(self) -> QuantizationScheme | None:
        """The scheme `hellbender quantize` applies: the QAT block's, else `quantization:`."""
        return self.qat or self.quantization


# What a null means for the keys of this module (`defaults.UNSET_MEANS`).
QUANTIZATION_UNSET_MEANS: dict[str, str] = {
    "qat": "no quantization-aware training",
    "quantization": "no post-training quantization scheme (`hellbender quantize` uses a QAT model's recorded one)",
    "activation_dtype": "weight-only quantization: the layers' inputs stay in the training precision",
    "fake_quant_after_n_steps": "fake-quantized from the first step",
}

# (weight_dtype, activation_dtype) -> the scheme's name, as docs/quantization.md and torchao name it.
SCHEMES: dict[tuple[str, str | None], str] = {
    ("int8", None): "int8 weight-only (IntxWeightOnlyConfig)",
    ("int4", None): "int4 weight-only (Int4WeightOnlyConfig)",
    ("int4", "int8"): "int8 dynamic activations + int4 weights (Int8DynamicActivationIntxWeightConfig)",
    ("float8", "float8"): "float8 dynamic activations + float8 weights (Float8DynamicActivationFloat8WeightConfig)",
    ("int4", "float8"): "float8 dynamic activations + int4 weights (Float8DynamicActivationInt4WeightConfig)",
    ("nvfp4", None): "NVFP4 weight-only (NVFP4WeightOnlyConfig)",
    ("nvfp4", "nvfp4"): "NVFP4 weights and activations (NVFP4DynamicActivationNVFP4WeightConfig)",
    ("mxfp4", "mxfp4"): "MXFP4 weights and activations (MXDynamicActivationMXWeightConfig)",
}
_FIXED_GROUP = {"nvfp4": 16, "mxfp4": 32}


def scheme_problems(scheme: QuantizationScheme, key: str) -> list[str]:
    """Why the pair of formats in `key:` (`qat` or `quantization`) names no scheme torchao offers."""
    pair = (scheme.weight_dtype, scheme.activation_dtype)
    if pair not in SCHEMES:
        offered = ", ".join(f"`{w}`" + (f" + `{a}`" if a else " alone") for w, a in SCHEMES)
        return [
            f"`{key}.weight_dtype: {pair[0]}` with `{key}.activation_dtype: {pair[1] or 'null'}` names no scheme that "
            f"torchao's quantization-aware training and quantization offer. The pairs (weight + activation) are: "
            f"{offered}."
        ]
    fixed = _FIXED_GROUP.get(scheme.weight_dtype)
    chosen = "group_size" in scheme.model_fields_set
    if fixed is not None and chosen and scheme.group_size != fixed:
        return [
            f"`{key}.group_size: {scheme.group_size}`: {scheme.weight_dtype} scales blocks of exactly {fixed} "
            f"weights. Set `{key}.group_size: {fixed}` (or remove it)."
        ]
    if scheme.weight_dtype == "float8" and chosen:
        return [
            f"`{key}.group_size: {scheme.group_size}`: float8 weights take one scale per tensor (torchao's default), not per group. Remove "
            f"`{key}.group_size`."
        ]
    return []
