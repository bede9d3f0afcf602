"""Load the tokenizer and the model a config names: a hub id, a local directory, or a built-in tiny model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from hellbender.chat_templates import resolve_chat_template
from hellbender.config import HellbenderConfig
from hellbender.config.config_class import config_class
from hellbender.config.model import is_hub_kernel
from hellbender.config.model_sources import local_source_problem
from hellbender.config.precision import torch_dtype
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models.architecture_class import class_for_config
from hellbender.models.attention_choice import NOT_SUPPORTED, eager_notice, falls_back_to_eager, refusal
from hellbender.models.fixes.encoders import causal_notice, make_causal
from hellbender.models.fixes.gemma4_assistant import refuse_assistant
from hellbender.models.fixes.musicgen import refuse_audio_decoder
from hellbender.models.fixes.reformer import check_training_length
from hellbender.models.fixes.xlnet import drop_trailing_padding_mask
from hellbender.models.fixes.xmod import check_language
from hellbender.models.hub_kernels import check_hub_kernel_packing, require_kernels_package
from hellbender.models.mistral_tokenizer import load_mistral_common_tokenizer
from hellbender.models.packed_attention import check_packed_masks
from hellbender.models.packed_vision import check_packable_vision_model
from hellbender.models.remote_code import remote_code_refused
from hellbender.models.router_aux_loss import check_router_aux_loss, check_router_overrides
from hellbender.models.tiny import is_tiny_model, tiny_model_dir

logger = logging.getLogger("hellbender")


def resolve_model_path(name: str, key: str = "base_model", wanted: Literal["model", "tokenizer"] = "model") -> str:
    """Built-in tiny models are built locally on first use; a path that is plainly local (`./`, `../`, `/`, `~`)
    must exist; an existing local path must hold what is `wanted`; any other name goes to transformers as is (a hub
    id)."""
    if is_tiny_model(name):
        return str(tiny_model_dir(name))
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
        raise ConfigError(
            f"`{key}: {name}` is a local path, but no such directory exists (relative paths start from the current "
            "directory). Check the path, or give a hub id such as `org/model`."
        )
    if problem := local_source_problem(name, key, wanted):
        raise ConfigError(problem)
    return name


def _tokenizer_source(cfg: HellbenderConfig) -> tuple[str, str, Literal["tokenizer"]]:
    key = "tokenizer_config" if cfg.tokenizer_config else "base_model"
    return getattr(cfg, key), key, "tokenizer"


def _transformers_class(name: str, key: str):
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ConfigError(f"`{key}: {name}` is not a transformers class with `from_pretrained`.")
    return cls


def load_tokenizer_and_processor(cfg: HellbenderConfig) -> tuple[Any, Any | None]:
    """The tokenizer, and for vision-language models (`processor_type`) the processor that holds it."""
    if not cfg.is_multimodal:
        return load_tokenizer(cfg), None
    if cfg.tokenizer_use_mistral_common:  # mistral-common encodes the images too, with its own image encoder
        from hellbender.models.mistral_processor import load_mistral_common_processor

        tokenizer = load_tokenizer(cfg)
        return tokenizer, load_mistral_common_processor(tokenizer, _tokenizer_source(cfg)[0])
    from hellbender.models.processor import load_processor

    processor = load_processor(cfg, resolve_model_path(*_tokenizer_source(cfg)))
    own = getattr(processor, "chat_template", None)
    if isinstance(own, str) and not processor.tokenizer.chat_template:
        # Vision-language repos often keep the model's template with the processor only (`chat_template.json`);
        # the tokenizer gets it too, so `tokenizer_default_fallback_<name>` sees that the model has one.
        processor.tokenizer.chat_template = own
    customise_tokenizer(cfg, processor.tokenizer)
    if cfg.chat_template != "tokenizer_default":
        processor.chat_template = processor.tokenizer.chat_template
    elif not getattr(processor, "chat_template", None):
        processor.chat_template = resolve_chat_template("tokenizer_default", None, processor.tokenizer)
    return processor.tokenizer, processor


def load_tokenizer(cfg: HellbenderConfig) -> Any:
    source = resolve_model_path(*_tokenizer_source(cfg))
    if cfg.tokenizer_use_mistral_common:
        # Its tokens are fixed by the tokenizer file (validation refuses `tokens` / `special_tokens`); only a
        # missing pad token is filled, as for any tokenizer.
        tokenizer = load_mistral_common_tokenizer(source, cfg.revision_of_model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    cls = _transformers_class(cfg.tokenizer_type, "tokenizer_type")
    legacy = {} if cfg.tokenizer_legacy is None else {"legacy": cfg.tokenizer_legacy}
    try:
        with remote_code_refused(source):
            tokenizer = cls.from_pretrained(
                source, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision_of_model, **legacy
            )
    except OSError as exc:
        raise ConfigError(
            f"Could not load the tokenizer from `{source}`: {str(exc).rstrip('.')}. Check `base_model` / `tokenizer_config` "
            "(a hub id needs network access; a local path must hold tokenizer files)."
        ) from None
    if legacy and getattr(tokenizer, "legacy", None) != cfg.tokenizer_legacy:
        raise ConfigError(
            f"`tokenizer_legacy: {str(cfg.tokenizer_legacy).lower()}` cannot be honoured: the tokenizer "
            f"`{type(tokenizer).__name__}` loaded from `{source}` does not read `legacy` (only SentencePiece-style "
            "tokenizers such as `LlamaTokenizer` do). Remove `tokenizer_legacy`, or set `tokenizer_type` to a class "
            "that reads it."
        )
    customise_tokenizer(cfg, tokenizer)
    return tokenizer


def customise_tokenizer(cfg: HellbenderConfig, tokenizer: Any) -> None:
    """Apply `special_tokens` and `chat_template`, and make sure there is a pad token."""
    if cfg.special_tokens:
        try:
            tokenizer.add_special_tokens(dict(cfg.special_tokens))
        except ValueError as exc:
            raise ConfigError(
                f"`special_tokens`: {exc}. Its keys are the tokenizer's named tokens (bos_token, eos_token, pad_token, "
                "unk_token, ...)."
            ) from None
    if cfg.tokens:
        tokenizer.add_tokens(list(cfg.tokens))
    if tokenizer.pad_token is None:
        # Padding is always masked by the attention mask and labels, so reusing EOS for it is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.chat_template != "tokenizer_default":
        tokenizer.chat_template = resolve_chat_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)


def quantization_config(cfg: HellbenderConfig):
    import torch

    bits = cfg.quantized_bits
    if bits is None:
        return None
    asked = "`adapter: qlora`" if bits == 4 else "`load_in_8bit: true`"
    if not torch.cuda.is_available():
        raise EnvironmentProblem(
            f"{asked} loads the base model in {bits}-bit with bitsandbytes, which needs a CUDA GPU, and none is "
            "visible here. Use `adapter: lora` with an unquantized base on this machine, or run on a GPU."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            f"{asked} needs the bitsandbytes package: `pip install 'hellbender[gpu]'` (or `pip install bitsandbytes`)."
        ) from None
    return bitsandbytes_config(cfg)


def quant_storage_dtype(cfg: HellbenderConfig) -> Any:
    """The dtype the packed 4-bit weights are stored as. Under FSDP2 it is the run's dtype: FSDP2 shards them as
    ordinary float tensors and casts every parameter of a group to the mixed-precision dtype (the run's) when it
    gathers them, which would rewrite packed bytes stored in any other dtype (bfloat16 storage gathered as float16
    gave outputs off by more than their own size; float32 storage gathered as bfloat16 failed to dequantize, seen
    with torch 2.13 and bitsandbytes 0.50.2). Elsewhere the storage dtype changes nothing and stays bfloat16."""
    import torch

    return torch_dtype(cfg) if cfg.uses_fsdp2 else torch.bfloat16


def bitsandbytes_config(cfg: HellbenderConfig):
    """transformers' `BitsAndBytesConfig` for the config's quantized base (no check of the machine)."""
    import torch
    from transformers import BitsAndBytesConfig

    if cfg.quantized_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch_dtype(cfg)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_settings.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_settings.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=compute if compute != torch.float32 else torch.bfloat16,
        bnb_4bit_quant_storage=quant_storage_dtype(cfg),
    )


def dequantizing_config(cfg: HellbenderConfig, config: Any, source: str) -> Any:
    """transformers' `model_quantization_config` class built from `model_quantization_config_kwargs`, for a checkpoint
    whose config.json says it is stored that way; validation has made sure it dequantizes while loading."""
    from hellbender.config.model_quantization import DEQUANTIZED_CONFIGS, quantization_config_class

    name = cfg.model_quantization_config
    stored = getattr(config, "quantization_config", None)
    method = stored.get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", None)
    method = getattr(method, "value", method)
    expected = DEQUANTIZED_CONFIGS[name][0]
    if method != expected:
        found = f"`quant_method: {method}`" if method else "no `quantization_config`"
        raise ConfigError(
            f"`model_quantization_config: {name}` dequantizes a checkpoint stored as `quant_method: {expected}`, but "
            f"`{source}` has {found} in its config.json. Remove `model_quantization_config` (and its kwargs) for this "
            "model: an unquantized checkpoint loads as it is."
        )
    return quantization_config_class(name)(**(cfg.model_quantization_config_kwargs or {}))


def check_new_embeddings_are_trained(cfg: HellbenderConfig, model: Any, added: int) -> None:
    """Tokens added by `tokens` / `special_tokens` get new embedding rows that start random: an adapter must train the
    embeddings and the output head in full, or the model learns nothing about those tokens."""
    if cfg.adapter is None:
        return
    names = {
        name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is model.get_input_embeddings()
    }
    head = model.get_output_embeddings()
    names |= {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if head is not None and module is head}
    missing = sorted(names - set(cfg.lora_modules_to_save))
    if missing:
        raise ConfigError(
            f"The tokenizer has {added} token(s) more than the model's embeddings (added by `tokens` / "
            "`special_tokens`): their embeddings start random, and a LoRA adapter does not train embeddings. Add "
            f"`lora_modules_to_save: [{', '.join(sorted(names))}]` to train them in full, or use tokens the "
            "tokenizer already has."
        )


def model_config(cfg: HellbenderConfig, source: str | Path) -> Any:
    """The model's config from `source`, read by `cls_model_config` (default `AutoConfig`), with
    `overrides_of_model_config` applied (each must be one of its settings, or of its text model's)."""
    if cfg.cls_model_config in (None, "AutoConfig"):
        from transformers import AutoConfig

        with remote_code_refused(source):
            try:
                config = AutoConfig.from_pretrained(
                    source, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision_of_model
                )
            except OSError as exc:
                raise _config_unreadable(source, exc) from None
    else:
        config = _config_read_by_class(cfg, source)
    check_router_overrides(config, cfg.overrides_of_model_config)
    for key, value in cfg.overrides_of_model_config.items():
        owner = next((c for c in (config, config.get_text_config()) if hasattr(c, key)), None)
        if owner is None:
            raise ConfigError(
                f"`overrides_of_model_config.{key}`: the model's config (`{config.model_type}`) has no setting "
                f"`{key}`. Check the name against the model's config.json."
            )
        setattr(owner, key, value)
    if not cfg.reward_model:  # a score over the whole sequence may look both ways
        make_causal(config, cfg.overrides_of_model_config)  # encoder families listed as causal LMs
    check_language(config)
    refuse_assistant(config)  # draft models that run on their target's states, not on token ids
    refuse_audio_decoder(config)  # causal LMs of audio codes
    check_training_length(config, cfg.sequence_len, cfg.pad_to_sequence_len)
    if cfg.reward_model:  # the score head: one number per sequence (`num_labels` is 1)
        config.num_labels = cfg.num_labels or 1
    return config


def _config_unreadable(source: str | Path, exc: OSError) -> ConfigError:
    reason = " ".join(str(exc).split()).rstrip(".")
    return ConfigError(
        f"Could not read the model's config from `{source}`: {reason}. Check `base_model` (a hub id needs network "
        "access or the model in the local hub cache; a local path must hold config.json)."
    )


def _config_read_by_class(cfg: HellbenderConfig, source: str | Path) -> Any:
    """`cls_model_config`'s class reads the config.json itself or, for a config of several models (a vision-language
    model's), the section of its own model type; a config.json of another model would be read into settings of the
    wrong model (transformers only warns), so it is refused."""
    cls = config_class(cfg)
    try:
        raw, _ = cls.get_config_dict(str(source), revision=cfg.revision_of_model)
    except OSError as exc:
        raise _config_unreadable(source, exc) from None
    described = {raw.get("model_type")} | {v.get("model_type") for v in raw.values() if isinstance(v, dict)}
    described.discard(None)
    if described and cls.model_type not in described:
        raise ConfigError(
            f"`cls_model_config: {cfg.cls_model_config}` reads configs of model type `{cls.model_type}`, and the "
            f"config.json of `{source}` describes {', '.join(f'`{t}`' for t in sorted(described))}, with no "
            f"`{cls.model_type}` section. Name the config class of that model's family, or remove `cls_model_config` "
            "(`AutoConfig` reads any config)."
        )
    return cls.from_pretrained(str(source), revision=cfg.revision_of_model)


def config_on_this_machine(cfg: HellbenderConfig) -> str | None:
    """Where `base_model`'s config.json can be read without the network: a built-in tiny model, a local directory,
    or a hub id's copy in the local cache (`revision_of_model`'s); None where only the hub has it."""
    name = cfg.base_model
    if is_tiny_model(name) or Path(name).expanduser().is_dir():
        return resolve_model_path(name)
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=cfg.revision_of_model)
    except ValueError:  # not a valid hub id either: `train` says so
        return None
    return str(Path(cached).parent) if isinstance(cached, str) else None


def model_skeleton(cfg: HellbenderConfig, source: str | None = None) -> Any:
    """The model's module tree on the meta device (no weights read, no memory used): for checks that need the
    model's structure before the data is prepared. `source`: where its config.json is, if not `base_model`."""
    import torch

    config = model_config(cfg, source or resolve_model_path(cfg.base_model))
    cls = class_for_config(_transformers_class(cfg.model_type, "model_type"), config)
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            return cls.from_config(config, trust_remote_code=cfg.trust_remote_code)
        return cls._from_config(config)


def _experts_argument(cfg: HellbenderConfig) -> dict[str, str]:
    # only when asked: transformers refuses the argument for models without experts
    return {"experts_implementation": cfg.experts_implementation} if cfg.experts_implementation else {}


def _random_model(cfg: HellbenderConfig, cls: Any, source: str, attention: str) -> Any:
    """`reinit_weights`: `base_model`'s architecture with freshly initialised weights, the same in every process
    (seeded by `seed`), so that data-parallel workers start from one model."""
    import torch

    config = model_config(cfg, source)
    config._attn_implementation = attention
    cls = class_for_config(cls, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
        return build(config, dtype=torch_dtype(cfg), **_experts_argument(cfg))


def load_model(cfg: HellbenderConfig, tokenizer: Any, source: str | Path | None = None) -> Any:
    """The model of `base_model`, or the whole model saved in `source` (a trained run's), loaded as the config says."""
    key = "`base_model`" if source is None else "the trained model's directory"
    source = resolve_model_path(cfg.base_model) if source is None else str(source)
    quant = quantization_config(cfg)
    require_kernels_package(cfg)
    cls = _transformers_class(cfg.model_type, "model_type")

    def load(attention: str) -> Any:
        if cfg.reinit_weights and key == "`base_model`":
            return _random_model(cfg, cls, source, attention)
        config = model_config(cfg, source)
        model_class = class_for_config(cls, config)
        quantization = quant
        if cfg.model_quantization_config and key == "`base_model`":  # a trained model is saved dequantized
            quantization = dequantizing_config(cfg, config, source)
        return model_class.from_pretrained(
            source,
            config=config,
            dtype=torch_dtype(cfg),
            attn_implementation=attention,
            quantization_config=quantization,
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision_of_model,
            **_experts_argument(cfg),
        )

    try:
        try:
            model = load(cfg.attn_implementation)
        except ValueError as exc:  # transformers refuses the backend while building the model, before the weights
            if not falls_back_to_eager(cfg, exc):
                raise
            logger.warning(eager_notice(exc))
            model = load("eager")
    except OSError as exc:
        raise ConfigError(
            f"Could not load the model from `{source}`: {str(exc).rstrip('.')}. Check {key} (a hub id needs network "
            "access; a local path must hold config.json and weights)."
        ) from None
    except ValueError as exc:
        repo = (cfg.attn_implementation or "").split(":")[0].split("@")[0]
        if is_hub_kernel(cfg.attn_implementation) and repo in str(exc):
            raise EnvironmentProblem(
                f"transformers could not use the hub kernel `attn_implementation: {cfg.attn_implementation}`: {exc} "
                "(a kernel is downloaded from the hub on first use; offline, it must be in the hub cache)."
            ) from None
        if NOT_SUPPORTED in str(exc):  # a backend the user chose (gpt-oss has no SDPA: attention sinks)
            raise refusal(cfg, exc) from None
        if cfg.experts_implementation is None:
            raise
        raise ConfigError(
            f"`experts_implementation: {cfg.experts_implementation}` cannot be used with this model: {exc} It applies "
            "to mixture-of-experts models; remove it."
        ) from None
    except ImportError as exc:
        raise EnvironmentProblem(
            f"Loading `{source}` with `attn_implementation: {cfg.attn_implementation}` failed: {exc}"
        ) from None
    if notice := causal_notice(getattr(model.config, "model_type", None) if not cfg.reward_model else None):
        logger.warning(notice)
    check_hub_kernel_packing(cfg, model)
    check_router_aux_loss(cfg, model)
    drop_trailing_padding_mask(model)
    if cfg.sample_packing or cfg.eval_sample_packing:
        check_packed_masks(model)
        if cfg.is_multimodal:
            check_packable_vision_model(model)
    embeddings = model.get_input_embeddings().weight
    # Under DeepSpeed ZeRO-3 the local tensor is an empty shard; `ds_shape` is the whole matrix's shape.
    rows = getattr(embeddings, "ds_shape", embeddings.shape)[0]
    if len(tokenizer) > rows:
        check_new_embeddings_are_trained(cfg, model, len(tokenizer) - rows)
        model.resize_token_embeddings(
            len(tokenizer), pad_to_multiple_of=32 if cfg.resize_token_embeddings_to_32x else None
        )
    text_config = model.config.get_text_config()
    # Some configs (CodeGen, RWKV, CPM-Ant) have no `pad_token_id` attribute at all, rather than None.
    if getattr(text_config, "pad_token_id", None) is None:
        text_config.pad_token_id = tokenizer.pad_token_id
    return model
