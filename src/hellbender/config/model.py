"""Config keys that choose and load the model and tokenizer."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hellbender.config.values import Name, PathText

AttnBackend = Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"]
# An attention kernel from the Hugging Face hub, loaded by transformers through the `kernels` package: `owner/repo`,
# optionally `@revision` and `:function` (transformers' own pattern for `attn_implementation`).
HUB_KERNEL = re.compile(r"^[^/:@|\s]+/[^/:@|\s]+(?:@[^/:@|\s]+)?(?::[^/:@|\s]+)?$")


def is_hub_kernel(attn_implementation: str | None) -> bool:
    return attn_implementation is not None and HUB_KERNEL.match(attn_implementation) is not None


class BnbSettings(BaseModel):
    """`bnb_config_kwargs:` — the bitsandbytes 4-bit settings a QLoRA run may choose."""

    model_config = ConfigDict(extra="forbid")

    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantize the quantization constants too.")


# torch.compile's keyword arguments that `flex_attn_compile_kwargs` may set, and the modes torch knows.
FLEX_COMPILE_KEYWORDS = ("dynamic", "mode", "fullgraph", "backend", "options")
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# `model_quantization_config` names hellbender loads -> (the checkpoint's `quant_method` in its config.json, what it
# stores); such checkpoints load dequantized for training (config/model_quantization.py).
DEQUANTIZED_CONFIGS: dict[str, tuple[str, str]] = {
    "Mxfp4Config": ("mxfp4", "MXFP4 (4-bit microscaling) weights, as gpt-oss ships its experts"),
    "FineGrainedFP8Config": ("fp8", "block-wise FP8 weights"),
}


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    base_model: PathText = Field(
        description=("Hub id, local directory, or a built-in offline model (`hellbender/tiny-llama`) to start from.")
    )
    model_type: Name | None = Field(
        None,
        description="transformers class used to load the model (an Auto class or a concrete class name); default "
        "`AutoModelForCausalLM`, or `AutoModelForImageTextToText` with `processor_type`.",
    )
    cls_model_config: Name | None = Field(
        None,
        description="transformers config class that reads `base_model`'s config.json instead of `AutoConfig` (e.g. "
        "`Gemma3TextConfig` with `model_type: Gemma3ForCausalLM`, to train the text model of a checkpoint whose "
        "config also describes a vision tower). It must be a config class of `model_type`'s model, and the "
        "checkpoint's config.json (or a section of it) must be of that class's model type.",
    )
    tokenizer_config: PathText | None = Field(
        None, description="Hub id or directory of the tokenizer, when it differs from `base_model`."
    )
    tokenizer_type: Name = Field("AutoTokenizer", description="transformers tokenizer class to load.")
    tokenizer_use_fast: bool = Field(
        True,
        description="Load the fast (Rust `tokenizers`) tokenizer, as transformers 5 always does. `false` (the slow "
        "Python tokenizer) is refused: transformers 5 no longer has slow tokenizers and ignores the request.",
    )
    tokenizer_legacy: bool | None = Field(
        None,
        description="Passed to the tokenizer as `legacy=`: for SentencePiece-style tokenizers (Llama's, "
        "`tokenizer_type: LlamaTokenizer`), `true` puts the word-start marker before the text after every special "
        "token, `false` only at the start of the text. Default: the tokenizer's own setting. A tokenizer that does not "
        "read it is refused when it loads.",
    )
    tokenizer_use_mistral_common: bool = Field(
        False,
        description="Load the tokenizer with Mistral's own `mistral-common` library (its `tekken.json` or "
        "`tokenizer.model.v*` file) instead of `tokenizer.json`, and let it encode `chat_template` conversations "
        "(no Jinja template); assistant turns and their EOS are trained. With `processor_type`, it encodes the "
        "images too (Mistral 3 / Pixtral: its image tokens and preprocessing). Needs `pip install "
        "'hellbender[mistral]'`.",
    )
    special_tokens: dict[str, Name] = Field(
        default_factory=dict,
        description="Special tokens to set on the tokenizer, e.g. `{pad_token: '<|pad|>'}`; new tokens grow the embeddings. "
        "A tokenizer without a pad token pads with its EOS token (padding is never attended to or trained).",
    )
    tokens: list[Name] = Field(
        default_factory=list,
        description="Ordinary (not special) tokens to add to the tokenizer; new tokens grow the embeddings.",
    )
    resize_token_embeddings_to_32x: bool = Field(
        False,
        description="When tokens are added, grow the embeddings to a multiple of 32 rows (faster matrix shapes on "
        "GPUs; the extra rows are never produced by the tokenizer).",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model and tokenizer code from the model repository to run. Off unless set."
    )
    revision_of_model: Name | None = Field(None, description="Git revision (branch, tag, commit) of `base_model`.")
    bf16: bool | Literal["auto"] = Field(
        "auto",
        description="Train in bfloat16 mixed precision; `auto` uses it where the GPU supports it. `true` on a machine "
        "without such a GPU: `train` stops at its start (`validate` notes it).",
    )
    fp16: bool = Field(
        False,
        description="Train in float16 mixed precision. Needs a CUDA GPU: without one `train` stops at its start "
        "(`validate` notes it).",
    )
    tf32: bool | None = Field(
        None,
        description="Allow TF32 matrix multiplies on Ampere and newer GPUs. Without one `train` stops at its start "
        "(`validate` notes it). `false` keeps them in float32.",
    )
    attn_implementation: str | None = Field(
        None,
        description="Attention backend: `eager`, `sdpa` (default; left out, an architecture without an SDPA path in "
        "transformers loads with `eager`, said in one line), `flash_attention_2`, `flash_attention_3`, "
        "`flex_attention`, or a hub kernel `owner/repo` (also `owner/repo@revision`, `owner/repo:function`, e.g. "
        "`kernels-community/vllm-flash-attn3`), which transformers loads with the `kernels` package. "
        "`flash_attention: true` is accepted as a synonym of `flash_attention_2`.",
    )
    flex_attn_compile_kwargs: dict[str, Any] | None = Field(
        None,
        description="With `attn_implementation: flex_attention`: keyword arguments for `torch.compile` of the flex "
        "attention kernel (`dynamic`, `mode`, `fullgraph`, `backend`, `options`), e.g. `{dynamic: false, mode: "
        "max-autotune-no-cudagraphs}`. With `dynamic: false` every new batch length compiles anew: set "
        "`pad_to_sequence_len: true`.",
    )
    flash_attention: bool = Field(False, description="Synonym for `attn_implementation: flash_attention_2`.")
    sdp_attention: bool = Field(False, description="Synonym for `attn_implementation: sdpa`.")
    load_in_4bit: bool = Field(
        False, description="Load the base model in 4-bit (bitsandbytes); needs `adapter: qlora`."
    )
    load_in_8bit: bool = Field(
        False,
        description="Load the base model in 8-bit (bitsandbytes LLM.int8) and train a LoRA adapter on it; needs "
        "`adapter: lora`, a CUDA GPU and bitsandbytes.",
    )

    bnb_config_kwargs: BnbSettings | None = Field(
        None,
        description="QLoRA's 4-bit quantization settings (bitsandbytes' names): `bnb_4bit_quant_type` (`nf4`, "
        "default, or `fp4`) and `bnb_4bit_use_double_quant` (default true).",
    )
    model_quantization_config: str | None = Field(
        None,
        description="A checkpoint stored quantized, loaded dequantized to the run's precision: `Mxfp4Config` (MXFP4 "
        "weights, e.g. gpt-oss's experts) or `FineGrainedFP8Config` (block-wise FP8 weights), transformers' class of "
        "that name; needs `model_quantization_config_kwargs: {dequantize: true}`.",
    )
    model_quantization_config_kwargs: dict[str, Any] | None = Field(
        None,
        description="Arguments of `model_quantization_config`'s class (its transformers names); `dequantize: true` "
        "is required, as hellbender cannot train MXFP4 or FP8 weights.",
    )
    reinit_weights: bool = Field(
        False,
        description="Start from randomly initialised weights of `base_model`'s architecture instead of its trained "
        "weights (pretraining from scratch); seeded by `seed`. Full fine-tuning only.",
    )
    overrides_of_model_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of the model's config.json to change before loading (e.g. `{output_router_logits: "
        "true, router_aux_loss_coef: 0.02}`: a mixture-of-experts router's load-balancing loss, weighted, joins the "
        "training loss; see docs/moe-lora.md); each must be a setting the model's config has. Axolotl's older "
        "spelling `model_config` is read as it.",
    )
    experts_implementation: str | None = Field(
        None,
        description="How mixture-of-experts layers compute their experts: a name transformers offers (`eager`, "
        "`grouped_mm`, `batched_mm`, ...); checked against the installed transformers. Default: transformers' choice.",
    )
    low_cpu_mem_usage: bool | None = Field(
        None,
        description="Axolotl's loader switch; transformers always loads weights without a second copy in memory, "
        "which is what `true` asks for, so either value changes nothing.",
    )
    experimental_skip_move_to_device: bool | None = Field(
        None,
        description="Axolotl's loader switch (do not move the whole model to the GPU before sharding it); hellbender "
        "leaves placement to accelerate and transformers, which never do that, so either value changes nothing.",
    )

    @field_validator("tokenizer_use_fast")
    @classmethod
    def _only_fast_tokenizers(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "cannot be honoured: transformers 5 has only fast (`tokenizers`) tokenizers and ignores a request "
                "for the slow one. Remove it, or set it to true"
            )
        return value

    @field_validator("cls_model_config")
    @classmethod
    def _config_class_is_a_transformers_config(cls, name: str | None) -> str | None:
        if name is None or name == "AutoConfig":
            return name
        import transformers

        found = getattr(transformers, name, None)
        if isinstance(found, type) and issubclass(found, transformers.PreTrainedConfig):
            return name
        what = "not a name transformers exports" if found is None else "a transformers name, but not a config class"
        raise ValueError(
            f"`{name}` is {what}; name a class such as `LlamaConfig` or `Gemma3TextConfig` (the "
            "`Config` class of the model's family), or remove the key to read the config with `AutoConfig`"
        )

    @field_validator("attn_implementation")
    @classmethod
    def _attention_is_a_backend_or_a_hub_kernel(cls, name: str | None) -> str | None:
        if name is None or name in get_args(AttnBackend) or is_hub_kernel(name):
            return name
        backends = ", ".join(f"`{n}`" for n in get_args(AttnBackend))
        raise ValueError(
            f"`{name}` is neither an attention backend ({backends}) nor a hub kernel `owner/repo` (optionally "
            "`owner/repo@revision` or `owner/repo:function`, e.g. `kernels-community/vllm-flash-attn3`)"
        )

    @field_validator("model_quantization_config")
    @classmethod
    def _quantization_config_is_offered(cls, name: str | None) -> str | None:
        if name is None or name in DEQUANTIZED_CONFIGS:
            return name
        import transformers

        offered = ", ".join(f"`{n}`" for n in DEQUANTIZED_CONFIGS)
        if name.endswith("Config") and hasattr(transformers, name):
            raise ValueError(
                f"`{name}` is a transformers quantization config hellbender does not load (it takes {offered}, "
                "checkpoints stored quantized that load dequantized for training); for an adapter on a quantized "
                "base use `adapter: qlora` or `load_in_8bit: true` (bitsandbytes)"
            )
        raise ValueError(f"`{name}` is not a quantization config hellbender knows; it takes {offered}")

    @field_validator("flex_attn_compile_kwargs")
    @classmethod
    def _flex_compile_kwargs_are_torch_compile_arguments(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs is None:
            return kwargs
        if "disable" in kwargs:
            raise ValueError(
                "`disable` is not accepted: uncompiled flex attention runs torch's reference implementation, which "
                "holds the whole [batch, heads, seq, seq] score matrix; use `attn_implementation: sdpa` instead"
            )
        unknown = sorted(set(kwargs) - set(FLEX_COMPILE_KEYWORDS))
        if unknown:
            raise ValueError(
                f"{', '.join(f'`{k}`' for k in unknown)} is not a keyword argument of torch.compile; the keys it takes "
                f"are {', '.join(f'`{k}`' for k in FLEX_COMPILE_KEYWORDS)}"
            )
        if "mode" in kwargs and kwargs["mode"] not in TORCH_COMPILE_MODES:
            raise ValueError(f"`mode` must be one of {', '.join(f'`{m}`' for m in TORCH_COMPILE_MODES)}")
        if "mode" in kwargs and "options" in kwargs:
            raise ValueError("torch.compile takes `mode` or `options`, not both; keep one")
        for key in ("dynamic", "fullgraph"):
            if key in kwargs and not isinstance(kwargs[key], bool | None):
                raise ValueError(f"`{key}` must be true or false")
        if "backend" in kwargs and not isinstance(kwargs["backend"], str):
            raise ValueError("`backend` must be the name of a torch.compile backend, e.g. `inductor`")
        if "options" in kwargs and not isinstance(kwargs["options"], dict):
            raise ValueError("`options` must be a mapping of inductor settings")
        return kwargs

    @field_validator("experts_implementation")
    @classmethod
    def _experts_implementation_is_offered(cls, name: str | None) -> str | None:
        if name is None:
            return name
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        offered = ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.valid_keys())]
        if name not in offered:
            raise ValueError(
                f"the installed transformers offers {', '.join(f'`{n}`' for n in offered)}; other expert kernels "
                "(Axolotl's `scattermoe`, ...) belong to mixture-of-experts training, which hellbender does not "
                "offer yet"
            )
        return name

    @property
    def bnb_settings(self) -> BnbSettings:
        return self.bnb_config_kwargs or BnbSettings()

    @property
    def quantized_bits(self) -> int | None:
        """4 or 8 when the base model is loaded quantized (QLoRA, 8-bit LoRA), else None."""
        return 4 if self.load_in_4bit else 8 if self.load_in_8bit else None
