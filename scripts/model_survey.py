"""Survey which architectures of the installed transformers train through hellbender, and write docs/models.md.

For each causal-LM model type (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) it builds a tiny random model from the type's
config class (hidden size, layers, heads, vocabulary and experts shrunk generically; `OVERRIDES` where that is not
enough), saves it with hellbender's tiny tokenizer, and trains it in a subprocess through hellbender's own path
(`load_config` + `train`, the code `hellbender train` runs) on the bundled chat data, with activation checkpointing:

- lora:    LoRA on every linear layer (`lora_target_linear: true`), 2 steps;
- packing: the same with `sample_packing: true`, 2 steps;
- full:    full fine-tuning, 1 step.

Each mode is recorded as ok / the error's class and first line / timeout, with the number of LoRA-adapted modules and
whether any expert weights were adapted. Results go to docs/models.json; the survey is resumable (recorded types are
skipped unless `--redo`), so it can run in pieces:

    python scripts/model_survey.py --types llama,qwen3_moe       # survey these (all unrecorded types without it)
    python scripts/model_survey.py --render                      # only rewrite docs/models.md from the JSON

The image-text-to-text section (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, `--vlm`) builds each family tiny with a
processor that works offline (hellbender's tiny VLM builders, or their pieces where a family shares a processor
class) and trains it through hellbender's multimodal path on the bundled coloured-squares image chat rows: LoRA on the
language model (2 steps) and full fine-tuning (1 step). A family without such a processor is recorded as
`not surveyed: <why>`; one hellbender refuses by name gets the generic shrink and shows the refusal:

    python scripts/model_survey.py --vlm --types llava,mllama    # survey these (all unrecorded VLM types without it)

Families whose processors need torchvision are surveyed with an interpreter that imports it (`TORCHVISION_BUILDERS`;
`TIMM_BUILDERS`: tiny models whose vision tower is a small timm model, which needs timm and so torchvision too);
their entries record the torch and torchvision versions, and a run without torchvision keeps them as recorded.
Inkling's (`inkling_mm_model`) vision tower also imports SciPy, which that interpreter needs for its row.

Runs offline on CPU; one core is enough (`OMP_NUM_THREADS=1 taskset -c 1 python ...`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "models.json"
DOC = ROOT / "docs" / "models.md"
CHAT_DATA = ROOT / "examples" / "data" / "chat.jsonl"
MODES = ("lora", "packing", "full")
NOT_SURVEYED = "not surveyed yet"
# The start of hellbender's refusal of `gradient_checkpointing` for a family (the survey then trains it without).
CHECKPOINTING_REFUSED = "`gradient_checkpointing` is set"
# The start of hellbender's one-line notice when `lora_target_linear` leaves layers out (models/fixes/unadaptable_layers).
LEFT_OUT = "`lora_target_linear` leaves out"

# Generic shrink: each target value applies to whichever of these names the config class has (and sets to an int).
HIDDEN = ("hidden_size", "n_embd", "d_model", "n_embed", "dim", "embed_dim", "model_dim", "backbone_hidden_size")
# Widths that must equal a (text or own) hidden size: vision and audio adapters into the text model (Dots 3), the
# global transformer seen from BLT's local encoder and decoder
HIDDEN += ("adapter_in_dim", "adapter_input_size", "adapter_out_dim", "hidden_size_global")
INTERMEDIATE = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim", "ffn_size")
EXPERT_INTERMEDIATE = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")
LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers")
HEADS = ("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")
FIXED = {  # MoE routing groups and multi-head latent attention ranks, when the config has them
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "encoder_hash_byte_group_vocab": 1024,  # BLT's hashed n-gram embeddings (500002 rows per group by default)
    "rotary_dim": 8,  # GPT-J and CodeGen rotate the first `rotary_dim` channels of each head
}
# FIXED sizes whose 0 turns the part off (Gemma 4 assistants have no per-layer inputs): a 0 stays 0.
OFF_AT_ZERO = {"hidden_size_per_layer_input"}
# Per-type keyword arguments where the generic shrink gives a config the model cannot be built from.
QWEN4_EXP_INDEXER = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
OVERRIDES: dict[str, dict[str, Any]] = {
    # the default leaves the sparse-attention indexer of its `indexed_attention` layers unset (read from a checkpoint)
    "qwen4_exp_text": QWEN4_EXP_INDEXER,
    "qwen4_exp": {"text_config": QWEN4_EXP_INDEXER},
    # the default has no rotary settings for its layer type (a checkpoint gives one per type)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # its mixer's heads must cover `hidden_size * expand` channels of `head_dim` each
    "mamba2": {"num_heads": 8},
    # the default leaves the layer pattern to a checkpoint; its model reads one type per layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # its attention reads `rope_theta` from the attention sub-config, whose class does not define it, and clamps
    # q/k/v by `clip_qkv`, which fails where it is unset (DBRX's checkpoints set both)
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # its causal LM class asserts the decoder switch, which the default leaves off, and its axial position
    # embeddings must add up to the hidden size (the shape's product is the training sequence length)
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 48], "axial_pos_shape": [8, 16]},
    # a drafter that reads every layer's K/V from its target model, without per-layer inputs; its config class's
    # defaults (the Gemma 4 text config's) are refused by its own validation
    # Mistral 4's `head_dim` is the whole query-key head (unrotated plus rotated channels, which its rotary embedding
    # takes `partial_rotary_factor` of), not only the rotated part as the shrink sets for latent attention
    "mistral4": {"head_dim": 16},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}
# Keys a type's runs add to the survey's config: what hellbender's refusal asks for, with the shrink above.
RUN_KEYS: dict[str, tuple[str, ...]] = {"reformer": ("pad_to_sequence_len: true",)}
# Types hellbender already builds tiny (with their own tokenizer): "module:function" saving into a directory.
OWN_BUILDERS = {"gemma4_text": "hellbender.models.tiny_vlm.gemma4:build_text"}
# Causal-LM types whose full model carries a timm vision tower (Gemma 3n's MobileNetV5): surveyed with an interpreter
# that has timm, their entries record its version.
CAUSAL_TIMM_TYPES = frozenset({"gemma3n"})


def _int_attr(config: Any, name: str) -> int | None:
    """The config's integer `name`, or None; a derived property (Falcon's `head_dim`) is not a setting."""
    if isinstance(getattr(type(config), name, None), property):
        return None
    try:
        value = getattr(config, name, None)
    except Exception:  # per-layer configs (Gemma 4) refuse reading a global value of a per-layer attribute
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _layer_pick(config: Any, layers: int) -> list[int]:
    """Which of the default layers to keep: the first of each distinct layer type (so a hybrid model keeps its
    attention and its recurrent layers), at least two. Where the last `num_kv_shared_layers` reuse the K/V of
    earlier layers of their type (Gemma 3n and 4), the same pick is made before and within that shared tail."""
    pattern = getattr(config, "layer_types", None)
    if not isinstance(pattern, (list, tuple)) or len(pattern) != layers:
        return [0, 1]

    def firsts(start: int, stop: int) -> list[int]:
        return sorted({str(pattern[i]): i for i in reversed(range(start, stop))}.values())

    shared = _int_attr(config, "num_kv_shared_layers") or 0
    if 0 < shared < layers:
        return firsts(0, layers - shared) + firsts(layers - shared, layers)
    picked = firsts(0, layers)
    return picked if len(picked) >= 2 else [0, 1]


def shrunk_kwargs(config: Any, vocab_size: int | None) -> dict[str, Any]:
    """Keyword arguments that rebuild `config` (a default instance of its class) tiny."""
    kwargs: dict[str, Any] = {}

    def put(names: tuple[str, ...], value: int) -> None:
        for name in names:
            if _int_attr(config, name) is not None:
                kwargs[name] = value

    put(HIDDEN, 64)
    put(INTERMEDIATE, 128)
    put(EXPERT_INTERMEDIATE, 32)
    put(HEADS, 4)
    heads = next((_int_attr(config, n) for n in HEADS if _int_attr(config, n)), None)
    for name in KV_HEADS:  # keep multi-head attention where the default has it, grouped query attention otherwise
        kv = _int_attr(config, name)
        if kv is not None:
            kwargs[name] = 4 if heads is not None and kv >= heads else min(kv, 2)
        elif name in vars(config) and vars(config)[name] is None:  # unset means one per query head (Nemotron)
            kwargs[name] = 4
    # Some defaults leave the expert count or the routing width to the checkpoint (dots1, DeepSeek-V2: None).
    settings = vars(config)
    kwargs.update({name: 4 for name in EXPERTS if name in settings and isinstance(settings[name], (int, type(None)))})
    if any(name in kwargs for name in EXPERTS):
        top = {name: settings[name] for name in EXPERTS_PER_TOKEN if name in settings}  # ZAYA routes to one only
        kwargs.update({name: min(k, 2) if isinstance(k, int) else 2 for name, k in top.items()})
        kwargs.update({name: 32 for name in EXPERT_INTERMEDIATE if settings.get(name, 0) is None})
        kwargs.update({name: 1 for name in ("n_shared_experts", "num_shared_experts") if settings.get(name, 0) is None})
    for name, value in FIXED.items():
        if _int_attr(config, name) not in (None, *([0] if name in OFF_AT_ZERO else [])):
            kwargs[name] = value
    if vars(config).get("head_dim", 0) is None:  # some defaults leave it to the checkpoint
        kwargs["head_dim"] = 16
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # latent attention rotates `head_dim` channels
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    for name in LAYERS:
        layers = _int_attr(config, name)
        if layers is None:
            continue
        picked = _layer_pick(config, layers) if layers > 2 else list(range(layers))
        kwargs[name] = len(picked)
        shared = _int_attr(config, "num_kv_shared_layers")
        if shared and name == "num_hidden_layers":  # all shared stays all shared; a shared tail keeps its pick
            kwargs["num_kv_shared_layers"] = len([i for i in picked if i >= layers - shared])
        for attr, value in vars(config).items():  # per-layer lists and pattern strings keep the picked layers
            per_layer = isinstance(value, (list, tuple)) or (isinstance(value, str) and "pattern" in attr)
            if attr != name and per_layer and len(value) == layers and layers > 2:
                kept = [value[i] for i in picked]
                kwargs[attr] = "".join(kept) if isinstance(value, str) else kept
    if vocab_size is not None:  # per-layer input embeddings have a vocabulary too (Gemma 3n and 4); Inkling 2 pads
        vocabularies = ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size")
        kwargs.update({name: vocab_size for name in vocabularies if _int_attr(config, name)})
    kwargs.update(_per_layer_config(config, kwargs))
    return kwargs


HEAD_PARTS = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")


def _per_layer_config(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A heterogeneous config's `per_layer_config` (layer index -> overrides) for the kept layers, renumbered, with
    each override the shrink also sets replaced by its shrunk value (Gemma 4's full-attention `head_dim`)."""
    try:
        per_layer = config.to_dict().get("per_layer_config")
    except Exception:
        return {}
    layers = next((_int_attr(config, n) for n in LAYERS if _int_attr(config, n) is not None), None)
    if not per_layer or layers is None:
        return {}
    picked = _layer_pick(config, layers) if layers > 2 else list(range(layers))
    overrides = {int(index): values for index, values in per_layer.items()}
    shrunk = {}
    for new, old in enumerate(picked):
        if old not in overrides:
            continue
        layer = {name: kwargs.get(name, value) for name, value in overrides[old].items()}
        # a layer whose head is its unrotated plus its rotated channels keeps that sum (Dots 3's sliding layers)
        head, nope, rope = (overrides[old].get(n, _int_attr(config, n)) for n in HEAD_PARTS)
        if None not in (head, nope, rope) and head == nope + rope:
            layer["head_dim"] = sum(layer.get(n, kwargs.get(n, overrides[old].get(n))) for n in HEAD_PARTS[1:])
        shrunk[new] = layer
    return {"per_layer_config": shrunk}


def tiny_config(model_type: str, tokenizer: Any, extra: dict[str, Any] | None = None) -> Any:
    """A tiny random-init config of `model_type`; composite configs shrink each sub-config the same way. `extra`
    overrides what the shrink gives, as `OVERRIDES` does (a sub-config's dict updates its shrunk dict)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    try:
        default = config_class()
    except Exception:  # a class whose own defaults fail its validation (Gemma 4 assistant)
        default = config_class(**OVERRIDES.get(model_type, {}))
    kwargs = shrunk_kwargs(default, len(tokenizer))
    for name in getattr(default, "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            # a text sub-config, or one with the model's own vocabulary (BLT's byte encoder, decoder and patcher)
            text = "text" in name or (_int_attr(sub, "vocab_size") or -1) == _int_attr(default, "vocab_size")
            kwargs[name] = {**sub.to_dict(), **shrunk_kwargs(sub, len(tokenizer) if text else None)}
            if text:  # the text model's padding embedding must lie inside the tiny vocabulary (Emu3, Mllama)
                special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
                kwargs[name].update({k: v for k, v in special.items() if kwargs[name].get(k) is not None})
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    kwargs.update({k: v for k, v in ids.items() if hasattr(default, k)})
    kwargs["tie_word_embeddings"] = False
    for overrides in (OVERRIDES.get(model_type, {}), extra or {}):  # a sub-config's overrides update its dict
        for name, value in overrides.items():
            kwargs[name] = {**kwargs[name], **value} if isinstance(kwargs.get(name), dict) else value
    try:
        return config_class(**kwargs)
    except Exception:  # no BOS, as hellbender's tiny models, unless the class insists on an integer (CWM)
        return config_class(**{**kwargs, "bos_token_id": tokenizer.eos_token_id})


def type_of_causal_lm(model_type: str) -> Any:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def causal_lm_part(model_type: str, config: Any) -> Any:
    """`config`, or the sub-config the type's causal-LM class is built from where the auto class cannot find it
    (MusicGen's decoder class names `decoder_config` as its key, but the composite holds it as `decoder`)."""
    own = type_of_causal_lm(model_type).config_class
    if isinstance(config, own) or isinstance(getattr(config, own.base_config_key or "", None), own):
        return config
    subs = (getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {})
    return next((sub for sub in subs if isinstance(sub, own)), config)


def build(model_type: str, target: Path) -> dict[str, Any]:
    """Save a tiny `model_type` model with hellbender's tiny tokenizer into `target`; returns what it is made of."""
    import torch
    from transformers import AutoModelForCausalLM

    from hellbender.models.tiny import build_tiny_tokenizer

    if model_type in OWN_BUILDERS:
        module, function = OWN_BUILDERS[model_type].split(":")
        getattr(importlib.import_module(module), function)(target)
        model = AutoModelForCausalLM.from_pretrained(target)
    else:
        tokenizer = build_tiny_tokenizer()
        config = tiny_config(model_type, tokenizer)
        torch.manual_seed(0)
        part = causal_lm_part(model_type, config)
        model = (
            AutoModelForCausalLM.from_config(config)
            if part is config
            else type_of_causal_lm(model_type)._from_config(part)
        )
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    names = [name for name, _ in model.named_parameters()]
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "moe": any("expert" in name for name in names),
        "bidirectional": sees_the_future(model),
        # transformers' own choice without `attn_implementation`: `eager` where the class has no SDPA path, which is
        # what hellbender then loads it with
        "attention": model.config._attn_implementation,
    }


def sees_the_future(model: Any) -> bool | None:
    """Whether a position's logits change when a later token changes: an encoder (BERT-like) loaded as a causal LM
    stays bidirectional unless its config says `is_decoder`, and would then train on the tokens it predicts.
    None where the model does not run on token ids alone."""
    import torch

    ids = torch.arange(10, 16).unsqueeze(0)
    changed = ids.clone()
    changed[0, -1] = 20
    model.eval()
    try:
        with torch.no_grad():
            before, after = (model(input_ids=x).logits[0, :-1] for x in (ids, changed))
    except Exception:
        return None
    return not torch.allclose(before, after, atol=1e-5)


def run_config(
    model_dir: Path, mode: str, output_dir: Path, checkpointing: bool = True, extra: tuple[str, ...] = ()
) -> str:
    lines = [
        f"base_model: {model_dir}",
        "datasets:",
        f"  - path: {CHAT_DATA}",
        "    type: chat_template",
        "    roles_to_train: [assistant]",
        "    train_on_eos: turn",
        f"dataset_prepared_path: {model_dir.parent / 'prepared'}",
        "sequence_len: 128",
        "micro_batch_size: 2",
        f"max_steps: {1 if mode == 'full' else 2}",
        "learning_rate: 1.0e-4",
        f"gradient_checkpointing: {str(checkpointing).lower()}",
        f"output_dir: {output_dir}",
    ]
    if mode != "full":
        lines += ["adapter: lora", "lora_r: 4", "lora_alpha: 8", "lora_target_linear: true"]
    if mode == "packing":
        lines.append("sample_packing: true")
    return "\n".join([*lines, *extra]) + "\n"


def adapter_facts(output_dir: Path) -> dict[str, Any]:
    """How many modules the saved adapter adapts, and whether any of them is an expert weight."""
    from safetensors import safe_open

    with safe_open(str(output_dir / "adapter_model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors file handle is not iterable itself
    modules = {name.split(".lora_A")[0] for name in names if ".lora_A" in name}
    return {"lora_modules": len(modules), "experts_adapted": any("expert" in m for m in modules)}


def reload_status(model_dir: Path, output_dir: Path, mode: str) -> str:
    """Whether plain transformers (and PEFT, for an adapter) load the saved output again, as a user would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hellbender.models.architecture_class import class_for_config

    try:  # the class `architectures` names where the auto class does not map the saved config (Emu3's text model)
        if mode == "full":
            class_for_config(AutoModelForCausalLM, AutoConfig.from_pretrained(output_dir)).from_pretrained(output_dir)
        else:
            from peft import PeftModel

            base = class_for_config(AutoModelForCausalLM, AutoConfig.from_pretrained(model_dir))
            PeftModel.from_pretrained(base.from_pretrained(model_dir), output_dir)
    except Exception as exc:
        return describe(exc)
    return "ok"


def describe(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def _is_refusal(exc: BaseException) -> bool:
    from hellbender.errors import UserError

    return isinstance(exc, UserError)


def raised_at(exc: BaseException) -> str:
    """Where the error was raised (file below site-packages or src, line, function) and, when that is in a library,
    the last hellbender frame that led there: enough to group failures by cause."""
    frames = traceback.extract_tb(exc.__traceback__)

    def where(frame: traceback.FrameSummary) -> str:
        return f"{re.split(r'site-packages/|/src/', frame.filename)[-1]}:{frame.lineno} in {frame.name}"

    ours = [f for f in frames if "/src/hellbender/" in f.filename]
    if not frames or frames[-1] in ours[-1:] or not ours:
        return where(frames[-1]) if frames else "?"
    return f"{where(frames[-1])} (from {where(ours[-1])})"


def worker(model_type: str, work: Path, partial: Path, section: str = "causal_lm") -> None:
    """Build and train one type, appending one JSON line per finished stage to `partial` (so a timeout still
    tells which stage it stopped in). `section` is `causal_lm` or `image_text_to_text` (the VLM section below)."""
    import logging

    logging.disable(logging.INFO)  # the libraries' chatter; hellbender's notices are warnings, collected below
    notices: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notices.append(record.getMessage())

    logging.getLogger("hellbender").addHandler(Collect(logging.WARNING))

    def record(stage: str, **facts: Any) -> None:
        with partial.open("a") as f:
            f.write(json.dumps({"stage": stage, **facts}) + "\n")

    vlm = section == VLM_SECTION
    model_dir = work / "model"
    try:
        record("build", status="ok", **(vlm_build if vlm else build)(model_type, model_dir))
    except Exception as exc:  # any failure is the finding
        record("build", status=describe(exc), where=raised_at(exc))
        return
    from hellbender.config import load_config
    from hellbender.train.run import train

    for mode in VLM_MODES if vlm else MODES:
        output_dir = work / f"out-{mode}"
        config = work / f"{mode}.yml"
        extra = RUN_KEYS.get(model_type, ())
        config.write_text(
            vlm_run_config(model_dir, mode, output_dir) if vlm else run_config(model_dir, mode, output_dir, extra=extra)
        )
        start = time.monotonic()
        del notices[:]
        checkpointing_refused = None
        try:
            try:
                metrics = train(load_config(config))
            except Exception as exc:  # a family whose checkpointing hellbender refuses trains without it
                if vlm or not _is_refusal(exc) or not str(exc).startswith(CHECKPOINTING_REFUSED):
                    raise
                checkpointing_refused = describe(exc)
                config.write_text(run_config(model_dir, mode, output_dir, checkpointing=False, extra=extra))
                metrics = train(load_config(config))
        except Exception as exc:
            # the same text on every run and checkout
            status = describe(exc).replace(str(model_dir), "<model dir>").replace(f"{ROOT}/", "")
            facts = {"status": status, "where": raised_at(exc), "refused": _is_refusal(exc)}
        else:
            facts = {}
        if not facts and metrics.get("exit_code"):  # stopped with a report and no final model (a diverged step)
            facts = {"status": f"stopped: {notices[-1] if notices else 'exit code ' + str(metrics['exit_code'])}"}
        elif not facts:
            facts = adapter_facts(output_dir) if mode != "full" else {}
            facts.update(status="ok", reload=(vlm_reload_status if vlm else reload_status)(model_dir, output_dir, mode))
        if left_out := [n for n in notices if n.startswith(LEFT_OUT)]:
            facts["left_out"] = left_out[0]
        if checkpointing_refused:
            facts["checkpointing_refused"] = checkpointing_refused
        record(mode, seconds=round(time.monotonic() - start, 1), **facts)


def _child(model_type: str, work: Path, partial: Path, section: str) -> None:
    """The forked process surveying one type: its own directory, its output in a log file there."""
    os.chdir(work)
    log = os.open(work / "output.log", os.O_WRONLY | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    worker(model_type, work, partial, section)


def survey(model_type: str, timeout: float, section: str = "causal_lm") -> dict[str, Any]:
    """Survey one type in a forked process (the libraries are imported once, in the parent; each type gets a
    fresh copy of their state, and a crash or a hang stops only its own process)."""
    import multiprocessing

    work = Path(tempfile.mkdtemp(prefix=f"{model_type}-", dir=os.environ.get("SURVEY_TMP")))
    partial = work / "stages.jsonl"
    args = (model_type, work, partial, section)
    process = multiprocessing.get_context("fork").Process(target=_child, args=args)
    process.start()
    process.join(timeout)
    timed_out = process.is_alive()
    if timed_out:
        process.kill()
        process.join()
    stages = [json.loads(line) for line in partial.read_text().splitlines()] if partial.exists() else []
    result: dict[str, Any] = {stage.pop("stage"): stage for stage in stages}
    missing = "timeout" if timed_out else f"process died: exit code {process.exitcode}"
    for stage in ("build", *(VLM_MODES if section == VLM_SECTION else MODES)):
        if stage not in result:
            result[stage] = {"status": missing if stage == "build" or result["build"]["status"] == "ok" else "-"}
            missing = "not run (an earlier stage stopped the process)"
    return result


def _import_once() -> None:
    """What every type's run needs, imported before the forks (offline: the hub client reads this when imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    sys.path.insert(0, str(ROOT / "src"))
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import hellbender.config  # noqa: F401
    import hellbender.train.run  # noqa: F401


# ---- the image-text-to-text section ----

VLM_SECTION = "image_text_to_text"
VLM_RESULTS_KEY = "_image_text_to_text"  # where docs/models.json keeps this section's results
VLM_MODES = ("lora", "full")
SHAPES_DATA = ROOT / "examples" / "data" / "shapes.jsonl"
NOT_SURVEYED_PREFIX = "not surveyed: "
# The tiny LLaVA's pieces (tokenizer with `<image>`, `LlavaProcessor` giving 16 image tokens per 32 x 32 image) also
# serve the families whose hub checkpoints use `LlavaProcessor` with a CLIP tower.
LLAVA_BUILDER = "hellbender.models.tiny_vlm.llava"


def _tiny_clip_vision(**extra: Any) -> Any:
    from transformers import CLIPVisionConfig

    from hellbender.models.tiny_vlm.llava import IMAGE_SIZE, PATCH_SIZE

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
    return CLIPVisionConfig(**{**sizes, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, **extra})


def build_vipllava(target: Path) -> None:
    """VipLLaVA: LLaVA's processor, a CLIP tower read at several layers (concatenated, normed, projected)."""
    import torch
    from transformers import LlamaConfig, VipLlavaConfig, VipLlavaForConditionalGeneration

    from hellbender.models.tiny import tiny_decoder_config
    from hellbender.models.tiny_vlm.llava import IMAGE_SEQ_LENGTH, IMAGE_TOKEN, build_processor, build_tokenizer

    tokenizer = build_tokenizer()
    config = VipLlavaConfig(
        vision_config=_tiny_clip_vision(num_hidden_layers=3),
        text_config=LlamaConfig(**tiny_decoder_config(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=IMAGE_SEQ_LENGTH,
        vision_feature_layers=[-3, -2],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    VipLlavaForConditionalGeneration(config).save_pretrained(target)
    build_processor(tokenizer).save_pretrained(target)


# Families on the Qwen2-VL / Qwen3-VL processors: the tiny Qwen-VL tokenizer, template and image processor fit them;
# their configs get the generic shrink with the tiny Qwen-VL vision settings. type -> the stock processor class.
QWEN_PROCESSOR_FAMILIES = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
    "qwen3_5_moe": "Qwen3VLProcessor",
    "qwen4_exp": "Qwen3VLProcessor",
    "cosmos3_omni": "Qwen3VLProcessor",  # Cosmos3's reasoner, Qwen3-VL's model under its own type
}


def build_qwen_family(model_type: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from hellbender.models.fixes import qwen2_vl, qwen3_vl
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer = tiny_qwen.build_tokenizer()
    ids = dict(
        zip(tiny_qwen.VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(tiny_qwen.VISION_TOKENS)), strict=True)
    )
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": tiny_qwen.PATCH_SIZE,
        "spatial_merge_size": tiny_qwen.MERGE_SIZE,
        "temporal_patch_size": tiny_qwen.TEMPORAL_PATCH_SIZE,
        "out_hidden_size": 64,
    }
    stock_name = QWEN_PROCESSOR_FAMILIES[model_type]
    if stock_name == "Qwen3VLProcessor":
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    else:  # Qwen2-VL's vision config calls its width `embed_dim` and the text width `hidden_size`
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
    extra = {"vision_config": vision, "text_config": {"rope_parameters": rope}, **tiny_qwen.token_ids(ids)}
    config = tiny_config(model_type, tokenizer, extra)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    # hellbender's image-only classes (no torchvision here), which save the stock class's files
    image_only = {
        "Qwen2VLProcessor": qwen2_vl.ImageOnlyQwen2VLProcessor,
        "Qwen3VLProcessor": qwen3_vl.ImageOnlyQwen3VLProcessor,
    }
    processor_class = image_only[stock_name]
    tiny_qwen.save_model_and_processor(model, processor_class, tokenizer, target)


def _chatml_template(image: str) -> str:
    """The tiny Qwen-VL ChatML template with an image part written as `image` (what the family's processor expands)."""
    from hellbender.models.tiny_vlm.qwen2_5_vl import CHAT_TEMPLATE

    template = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", image)
    return template.replace("<|vision_start|><|video_pad|><|vision_end|>", "")


def _save_generic(model_type: str, target: Path, tokenizer: Any, processor: Any, extra: dict[str, Any]) -> None:
    """The type's config with the generic shrink and `extra`, random weights, saved with `processor`."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(tiny_config(model_type, tokenizer, extra)).save_pretrained(target)
    processor.save_pretrained(target)


def build_gemma3(target: Path, model_type: str = "gemma3") -> None:
    """Gemma 3: a SigLIP tower (32 x 32 images, 8 px patches) pooled to 2 x 2 = 4 soft tokens per image, with
    `Gemma3Processor` expanding each `<start_of_image>` into them."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    template = _chatml_template(named["boi_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    if model_type == "shieldgemma2":  # its own processor: it writes a policy prompt per image (one policy here)
        from transformers import ShieldGemma2Processor

        policies = {"tiny": "No tiny squares."}
        processor = ShieldGemma2Processor(
            image_processor, tokenizer, chat_template=template, image_seq_length=4, policy_definitions=policies
        )
    else:
        processor = Gemma3Processor(image_processor, tokenizer, chat_template=template, image_seq_length=4)
    ids = {f"{name[:3]}_token_index": tokenizer.convert_tokens_to_ids(token) for name, token in named.items()}
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "mm_tokens_per_image": 4,
        "boi_token_index": ids["boi_token_index"],
        "eoi_token_index": ids["eoi_token_index"],
        "image_token_index": ids["ima_token_index"],
    }
    if model_type == "t5gemma2":  # an encoder-decoder whose encoder is Gemma 3's image-text composite
        extra = {"encoder": _shrunk_composite(model_type, "encoder", tokenizer, extra), **_slice(extra, "_index")}
    _save_generic(model_type, target, tokenizer, processor, extra)


def _slice(values: dict[str, Any], suffix: str) -> dict[str, Any]:
    return {name: value for name, value in values.items() if name.endswith(suffix)}


def _shrunk_composite(model_type: str, name: str, tokenizer: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The composite sub-config `name` of `model_type`'s default config, each of its own sub-configs shrunk (the
    generic shrink goes one level down only), with `extra` on top."""
    from transformers import CONFIG_MAPPING

    composite = getattr(CONFIG_MAPPING[model_type](), name)
    shrunk = composite.to_dict()
    for sub_name in composite.sub_configs:
        sub = getattr(composite, sub_name)
        vocab = len(tokenizer) if "text" in sub_name else None
        shrunk[sub_name] = {**sub.to_dict(), **shrunk_kwargs(sub, vocab), **extra.get(sub_name, {})}
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    if "text_config" in shrunk:  # a vision composite has none (DeepSeek-OCR-2's SAM tower and encoder)
        shrunk["text_config"].update(special)
    return {**shrunk, **{k: v for k, v in extra.items() if k not in composite.sub_configs}}


def _llava_next_tiles() -> Any:
    """LLaVA-NeXT's image processor at the tiny LLaVA's size: a 32 x 32 base view and the tiles of the best-fitting
    grid among 1 x 1, 1 x 2 and 2 x 1."""
    from transformers import LlavaNextImageProcessorPil

    from hellbender.models.tiny_vlm.llava import IMAGE_SIZE

    pinpoints = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
    return LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=pinpoints,
    )


def build_llava_next(target: Path) -> None:
    """LLaVA-NeXT: the tiny LLaVA's tokenizer and template, any-resolution tiles of 32 x 32 (a base view and the
    tiles of the best-fitting grid) through a CLIP tower."""
    from transformers import LlavaNextProcessor

    from hellbender.models.tiny_vlm.llava import (
        IMAGE_SIZE,
        IMAGE_TOKEN,
        LLAVA_CHAT_TEMPLATE,
        PATCH_SIZE,
        build_tokenizer,
    )

    tokenizer = build_tokenizer()
    image_processor = _llava_next_tiles()
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    extra = {
        "vision_config": {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE},
        "image_grid_pinpoints": image_processor.image_grid_pinpoints,
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
    }
    _save_generic("llava_next", target, tokenizer, processor, extra)


def build_paligemma(target: Path) -> None:
    """PaliGemma: a SigLIP tower (32 x 32 images, 8 px patches: 16 `<image>` tokens) into a Gemma."""
    from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<image>")
    # its processor starts each prompt with BOS (after the image tokens), which the tiny tokenizer lacks otherwise
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<image>", bos_token="<bos>")
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = 16
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8, "projection_dim": 64},
        "text_config": {"hidden_size": 64},
        "projection_dim": 64,
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
    }
    _save_generic("paligemma", target, tokenizer, processor, extra)


def build_idefics2(target: Path) -> None:
    """Idefics2: the tiny Idefics3's tokenizer and template; one 32 x 32 view per image (no splitting), resampled by
    the perceiver to 4 latents, so each `<image>` becomes 4 image tokens between `<fake_token_around_image>`."""
    from transformers import Idefics2ImageProcessorPil, Idefics2Processor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm.idefics3 import (
        CHAT_TEMPLATE,
        END_OF_UTTERANCE,
        FAKE_IMAGE_TOKEN,
        IMAGE_TOKEN,
        PATCH_SIZE,
    )

    # the processor reads the image boundary token from the tokenizer when the tokenizer names its image token
    named = {"image_token": IMAGE_TOKEN, "image_boundary_token": FAKE_IMAGE_TOKEN}
    tokenizer = build_tiny_tokenizer(extra_special_tokens=(END_OF_UTTERANCE,), chat_template=CHAT_TEMPLATE, **named)
    tokenizer.eos_token = END_OF_UTTERANCE
    image_processor = Idefics2ImageProcessorPil(
        do_image_splitting=False, size={"shortest_edge": 32, "longest_edge": 32}
    )
    processor = Idefics2Processor(image_processor, tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": PATCH_SIZE},
        "perceiver_config": {"resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 2,
                             "resampler_head_dim": 16, "num_key_value_heads": 1},
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
    }  # fmt: skip
    _save_generic("idefics2", target, tokenizer, processor, extra)


def build_granite_docling(target: Path) -> None:
    """Granite Docling: Idefics3's prompt layout (the tiny Idefics3's tokenizer and template), 32 x 32 tiles."""
    from transformers import GraniteDoclingImageProcessorPil, GraniteDoclingProcessor

    from hellbender.models.tiny_vlm import idefics3 as tiny

    tokenizer = tiny.build_tokenizer()
    # pages are cut into tiles of the vision tower's size (at most 2 x 2 here) plus a thumbnail
    tile = {"height": tiny.VISION_IMAGE_SIZE, "width": tiny.VISION_IMAGE_SIZE}
    image_processor = GraniteDoclingImageProcessorPil(size=tile, max_patches=4)
    processor = GraniteDoclingProcessor(
        image_processor, tokenizer, image_seq_len=tiny.IMAGE_SEQ_LEN, chat_template=tiny.CHAT_TEMPLATE
    )
    extra = {
        "vision_config": {
            "image_size": tiny.VISION_IMAGE_SIZE,
            "patch_size": tiny.PATCH_SIZE,
            "out_hidden_size": 64,
            "scale_factor": tiny.SCALE_FACTOR,  # the vision config's, which the connector reads
        },
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny.IMAGE_TOKEN),
    }
    _save_generic("granite_docling", target, tokenizer, processor, extra)


def build_lighton_ocr(target: Path) -> None:
    """LightOnOCR: a Pixtral tower (8 px patches) merged 2 x 2 into a Qwen3; a 32 x 32 image gives 4 image tokens."""
    from transformers import LightOnOcrProcessor, PixtralImageProcessorPil

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>", "image_end_token": "<|vision_end|>"}
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    # the image processor rounds sizes to whole merged patches (patch 8 x merge 2)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size=16)
    processor = LightOnOcrProcessor(
        image_processor, tokenizer, patch_size=8, spatial_merge_size=2, chat_template=template
    )
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8, "head_dim": 16},
        "spatial_merge_size": 2,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
    }
    _save_generic("lighton_ocr", target, tokenizer, processor, extra)


def build_aya_vision(target: Path) -> None:
    """Aya Vision: a SigLIP tower (32 x 32 tiles, 8 px patches) pixel-shuffled 2 x 2, so each tile gives 4
    `<|IMG_PATCH|>` tokens between the processor's image markers; a 32 x 32 image is one tile."""
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessorPil

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ("<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>")
    template = _chatml_template("<image>")
    tokenizer = build_tiny_tokenizer(extra_special_tokens=markers, chat_template=template, image_token="<image>")
    image_processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    processor = AyaVisionProcessor(
        image_processor, tokenizer, patch_size=8, img_size=32, downsample_factor=2, chat_template=template
    )
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "downsample_factor": 2,
        "image_token_index": tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
    }
    _save_generic("aya_vision", target, tokenizer, processor, extra)


def build_blip2(target: Path, model_type: str = "blip-2") -> None:
    """BLIP-2 / InstructBLIP: a tiny vision tower and Q-Former whose 4 query outputs fill 4 `<image>` tokens that the
    processor puts before each text (the text itself has no image placeholder, which is why hellbender refuses them;
    built whole so the survey shows that refusal on a real model)."""
    import transformers
    from transformers import BlipImageProcessorPil

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<image>")
    image_processor = BlipImageProcessorPil(size={"height": 32, "width": 32})
    if model_type == "instructblip":  # its Q-Former reads the text too, through a tokenizer of its own
        processor = transformers.InstructBlipProcessor(
            image_processor, tokenizer, build_tiny_tokenizer(), num_query_tokens=4, chat_template=template
        )
    else:
        processor = transformers.Blip2Processor(image_processor, tokenizer, num_query_tokens=4, chat_template=template)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "qformer_config": {"encoder_hidden_size": 64, "vocab_size": len(tokenizer)},
        "num_query_tokens": 4,
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
    }
    _save_generic(model_type, target, tokenizer, processor, extra)


def build_paddleocr_vl(target: Path) -> None:
    """PaddleOCR-VL: the tiny Qwen-VL tokenizer and template, its own image processor at the tiny Qwen-VL sizes (a
    32 x 32 image becomes 4 x 4 patches of 4 px, merged 2 x 2 into 4 `<|image_pad|>` tokens)."""
    from transformers import PaddleOCRVLImageProcessorPil, PaddleOCRVLProcessor

    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer = tiny_qwen.build_tokenizer()
    image_processor = PaddleOCRVLImageProcessorPil(
        patch_size=tiny_qwen.PATCH_SIZE,
        merge_size=tiny_qwen.MERGE_SIZE,
        temporal_patch_size=1,
        min_pixels=tiny_qwen.MIN_PIXELS,
        max_pixels=tiny_qwen.MAX_PIXELS,
    )
    processor = PaddleOCRVLProcessor(image_processor, tokenizer, chat_template=tiny_qwen.CHAT_TEMPLATE)
    extra = {
        "vision_config": {"patch_size": tiny_qwen.PATCH_SIZE, "spatial_merge_size": tiny_qwen.MERGE_SIZE},
        "text_config": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3]}
        },
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.IMAGE_PAD),
    }
    _save_generic("paddleocr_vl", target, tokenizer, processor, extra)


def build_deepseek_vl(target: Path) -> None:
    """DeepSeek-VL: a SigLIP tower (32 x 32 images, 8 px patches) giving 16 `<image_placeholder>` tokens."""
    from transformers import DeepseekVLImageProcessorPil, DeepseekVLProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<image_placeholder>")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<image_placeholder>")
    image_processor = DeepseekVLImageProcessorPil(size={"height": 32, "width": 32})
    processor = DeepseekVLProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=16)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "image_token_id": tokenizer.convert_tokens_to_ids("<image_placeholder>"),
    }
    _save_generic("deepseek_vl", target, tokenizer, processor, extra)


def build_hunyuan_vl(target: Path) -> None:
    """HunYuan-VL: Qwen-VL-like patches (4 px, merged 2 x 2) with a row break after each row of merged patches and
    start / end tokens around each image, on the tiny tokenizer."""
    from transformers import HunYuanVLImageProcessorPil, HunYuanVLProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    named = {"image_token": "<|image_pad|>", "image_start_token": "<|image_start|>", "image_end_token": "<|image_end|>"}
    template = _chatml_template("<|image_start|><|image_pad|><|image_end|>")
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = HunYuanVLImageProcessorPil(
        patch_size=tiny_qwen.PATCH_SIZE,
        merge_size=tiny_qwen.MERGE_SIZE,
        size={"shortest_edge": tiny_qwen.MIN_PIXELS, "longest_edge": tiny_qwen.MAX_PIXELS},
    )
    processor = HunYuanVLProcessor(image_processor, tokenizer, chat_template=template)
    ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in named.items()}
    extra = {
        "vision_config": {"patch_size": tiny_qwen.PATCH_SIZE, "spatial_merge_size": tiny_qwen.MERGE_SIZE},
        # a checkpoint gives the multimodal RoPE axes (sequence, width, height, image), summing to head_dim / 2
        "text_config": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2, 2]}
        },
        **ids,
    }
    _save_generic("hunyuan_vl", target, tokenizer, processor, extra)


def build_mistral3(target: Path, model_type: str = "mistral3", text_type: str | None = None) -> None:
    """Mistral 3 (and Mistral Large 4, the same layout on a DeepSeek-like MoE text model): a Pixtral tower (8 px patches) merged 2 x 2 into the text model; `PixtralProcessor` (a torchvision
    class) writes `[IMG]` per merged patch, `[IMG_BREAK]` after each row and `[IMG_END]` after the image."""
    from transformers import PixtralImageProcessorPil, PixtralProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    # the image processor rounds sizes to whole merged patches (patch 8 x merge 2)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size=16)
    processor = PixtralProcessor(
        image_processor, tokenizer, patch_size=8, spatial_merge_size=2, chat_template=template, **named
    )
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8, "head_dim": 16},
        "spatial_merge_size": 2,
        "image_token_index": tokenizer.convert_tokens_to_ids(named["image_token"]),
    }
    if text_type is None:
        _save_generic(model_type, target, tokenizer, processor, extra)
        return
    # Mistral Small 4: a `mistral3` checkpoint whose text model is a `mistral4` (shrunk as the causal-LM survey does)
    import torch
    from transformers import AutoModelForImageTextToText

    config = tiny_config(model_type, tokenizer, extra)
    config.text_config = tiny_config(text_type, tokenizer, OVERRIDES.get(text_type))
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(target)
    processor.save_pretrained(target)


def build_mistral4(target: Path) -> None:
    """Mistral 4: the `mistral4` type is the text model (`Mistral4ForCausalLM`, which the image-text mapping names);
    its image-text checkpoints (Mistral Small 4) are Mistral 3's composite (`mistral3`: Pixtral tower, 2 x 2 merge,
    `PixtralProcessor`) with a `mistral4` text config, built so here."""
    build_mistral3(target, "mistral3", text_type="mistral4")


def build_fast_vlm(target: Path) -> None:
    """FastVLM: a hybrid convolutional tower (timm; its small `test_convnext` in place of FastViT-HD: a 64 x 64 image
    gives 2 x 2 features of 64 channels) whose feature map, flattened, is projected into a Qwen2. Its checkpoints name
    `LlavaProcessor`: on the tiny LLaVA's tokenizer and template, with the tower's stride (32 px) as the patch size
    and the `full` strategy (no CLS position), each `<image>` becomes 4 image tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from hellbender.models.tiny_vlm.llava import IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=32,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        image_token=IMAGE_TOKEN,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    extra = {
        "vision_config": {"architecture": "test_convnext", "hidden_size": 64, "model_args": None},
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "image_seq_length": 4,
    }
    _save_generic("fast_vlm", target, tokenizer, processor, extra)


# The audio markers that the Qwen Omni thinkers' processors read from the tokenizer (beside the Qwen-VL vision ones).
OMNI_AUDIO_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


def build_qwen_omni_thinker(target: Path, model_type: str) -> None:
    """Qwen2.5-Omni's and Qwen3-Omni-MoE's thinkers (the text-generating half of the omni models): a Qwen-VL tower
    on Qwen-VL patches (the tiny Qwen-VL tokenizer, template and sizes: 4 px, merged 2 x 2) and an audio tower beside
    the text model. Their checkpoints name the omni processor (`Qwen2_5OmniProcessor` / `Qwen3OmniMoeProcessor`:
    Qwen2-VL's image and video processors, a Whisper feature extractor), whose tokenizer names the vision and audio
    markers."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLVideoProcessor, WhisperFeatureExtractor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    named = {
        "image_token": tiny_qwen.IMAGE_PAD,
        "video_token": tiny_qwen.VIDEO_PAD,
        "vision_bos_token": tiny_qwen.VISION_START,
        "vision_eos_token": tiny_qwen.VISION_END,
        **OMNI_AUDIO_TOKENS,
    }
    tokenizer = build_tiny_tokenizer(chat_template=tiny_qwen.CHAT_TEMPLATE, **named)
    patches = _tiny_qwen_patches()
    processor = getattr(transformers, CHECKPOINT_PROCESSORS[model_type])(
        Qwen2VLImageProcessorPil(**patches),
        Qwen2VLVideoProcessor(**patches),
        WhisperFeatureExtractor(feature_size=128),
        tokenizer,
        chat_template=tiny_qwen.CHAT_TEMPLATE,
    )
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in named.items()}
    vision = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": tiny_qwen.PATCH_SIZE,
        "spatial_merge_size": tiny_qwen.MERGE_SIZE,
        "temporal_patch_size": tiny_qwen.TEMPORAL_PATCH_SIZE,
        "out_hidden_size": 64,
    }
    if model_type == "qwen3_omni_moe_thinker":
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    else:
        vision.update(window_size=8, fullatt_block_indexes=[1])
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
    extra = {
        "vision_config": vision,
        "audio_config": {"output_dim": 64},
        "text_config": {"rope_parameters": rope, "head_dim": 16},
        "image_token_id": ids["image_token"],
        "video_token_id": ids["video_token"],
        "audio_token_id": ids["audio_token"],
        "audio_start_token_id": ids["audio_bos_token"],
        "audio_end_token_id": ids["audio_eos_token"],
        "vision_start_token_id": ids["vision_bos_token"],
        "vision_end_token_id": ids["vision_eos_token"],
    }
    _save_generic(model_type, target, tokenizer, processor, extra)


def build_llava_onevision(target: Path) -> None:
    """LLaVA-OneVision: LLaVA-NeXT's any-resolution tiles of 32 x 32 through a CLIP tower, on the tiny LLaVA's
    tokenizer and template with a `<video>` token; its processor always carries a video processor (torchvision)."""
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm.llava import IMAGE_SIZE, IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, PATCH_SIZE

    tokenizer = build_tiny_tokenizer(chat_template=LLAVA_CHAT_TEMPLATE, image_token=IMAGE_TOKEN, video_token="<video>")
    pinpoints = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_grid_pinpoints=pinpoints
    )
    video_processor = LlavaOnevisionVideoProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        num_image_tokens=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    extra = {
        "vision_config": {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE},
        "image_grid_pinpoints": image_processor.image_grid_pinpoints,
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "video_token_index": tokenizer.convert_tokens_to_ids("<video>"),
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -2,
    }
    _save_generic("llava_onevision", target, tokenizer, processor, extra)


def build_smolvlm(target: Path) -> None:
    """SmolVLM: Idefics3's prompt layout (the tiny Idefics3's tokenizer, template and tile sizes); its processor
    always carries a video processor (torchvision)."""
    from transformers import SmolVLMImageProcessorPil, SmolVLMProcessor, SmolVLMVideoProcessor

    from hellbender.models.tiny_vlm import idefics3 as tiny

    tokenizer = tiny.build_tokenizer()
    image_processor = SmolVLMImageProcessorPil(
        do_image_splitting=True,
        size={"longest_edge": tiny.LONGEST_EDGE},
        max_image_size={"longest_edge": tiny.VISION_IMAGE_SIZE},
    )
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": tiny.VISION_IMAGE_SIZE}, max_image_size={"longest_edge": tiny.VISION_IMAGE_SIZE}
    )
    processor = SmolVLMProcessor(
        image_processor, tokenizer, video_processor, image_seq_len=tiny.IMAGE_SEQ_LEN, chat_template=tiny.CHAT_TEMPLATE
    )
    extra = {
        "vision_config": {"image_size": tiny.VISION_IMAGE_SIZE, "patch_size": tiny.PATCH_SIZE},
        "scale_factor": tiny.SCALE_FACTOR,
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny.IMAGE_TOKEN),
    }
    _save_generic("smolvlm", target, tokenizer, processor, extra)


def build_internvl(target: Path) -> None:
    """InternVL: an InternViT tower (32 x 32 images, 8 px patches) pixel-shuffled 2 x 2, so each image becomes 4
    `<IMG_CONTEXT>` tokens between `<img>` and `</img>`; its processor always carries a video processor."""
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor, InternVLVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    template = _chatml_template(named["context_image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    video_processor = InternVLVideoProcessor(size={"height": 32, "width": 32})
    processor = InternVLProcessor(
        image_processor, tokenizer, video_processor, image_seq_length=4, chat_template=template
    )
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "image_seq_length": 4,
        "downsample_ratio": 0.5,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["context_image_token"]),
    }
    _save_generic("internvl", target, tokenizer, processor, extra)


def build_llava_next_video(target: Path) -> None:
    """LLaVA-NeXT-Video: LLaVA-NeXT's tiles (`build_llava_next`'s sizes) with a `<video>` token and a video
    processor (torchvision) beside the image processor."""
    from transformers import LlavaNextVideoProcessor, LlavaNextVideoVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm.llava import IMAGE_SIZE, IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, PATCH_SIZE

    tokenizer = build_tiny_tokenizer(chat_template=LLAVA_CHAT_TEMPLATE, image_token=IMAGE_TOKEN, video_token="<video>")
    image_processor = _llava_next_tiles()
    video_processor = LlavaNextVideoVideoProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaNextVideoProcessor(
        video_processor=video_processor,
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    extra = {
        "vision_config": {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE},
        "image_grid_pinpoints": image_processor.image_grid_pinpoints,
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "video_token_index": tokenizer.convert_tokens_to_ids("<video>"),
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
    }
    _save_generic("llava_next_video", target, tokenizer, processor, extra)


# GLM-4V-layout types whose checkpoints use other classes than Glm4v's: type -> (image and video processor prefix,
# processor prefix)
GLM_PROCESSOR_PREFIXES = {
    "glm46v": ("Glm46V", "Glm46V"),
    "glm_ocr": ("Glm46V", "Glm46V"),
    "glmga": ("Glmga", "Glm46V"),
}


def build_glm4v(target: Path, model_type: str = "glm4v") -> None:
    """GLM-4V (and GLM-4.5V, its MoE, GLM-4.6V, GLM-OCR and Glmga): Qwen-VL-like patches at the tiny Qwen-VL sizes (4 px, merged 2 x 2) between
    `<|begin_of_image|>` and `<|end_of_image|>`, on the tiny tokenizer; its processor always carries a video
    processor (torchvision)."""
    import transformers

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    markers = ("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>")
    template = _chatml_template("<|begin_of_image|><|image|><|end_of_image|>")
    tokenizer = build_tiny_tokenizer(
        extra_special_tokens=markers, chat_template=template, image_token="<|image|>", video_token="<|video|>"
    )
    patches = {"patch_size": tiny_qwen.PATCH_SIZE, "merge_size": tiny_qwen.MERGE_SIZE, "temporal_patch_size": 2}
    sizes = {"shortest_edge": tiny_qwen.MIN_PIXELS, "longest_edge": tiny_qwen.MAX_PIXELS}
    # GLM-4.6V has its own classes of the same layout, which GLM-OCR's checkpoints name too; Glmga's checkpoints pair
    # GLM-4.6V's processor with Glmga's own image and video processors
    prefix, processor_prefix = GLM_PROCESSOR_PREFIXES.get(model_type, ("Glm4v", "Glm4v"))
    image_processor = getattr(transformers, f"{prefix}ImageProcessorPil")(size=sizes, **patches)
    video_processor = getattr(transformers, f"{prefix}VideoProcessor")(size=sizes, **patches)
    processor = getattr(transformers, f"{processor_prefix}Processor")(
        image_processor, tokenizer, video_processor, chat_template=template
    )
    ids = tokenizer.convert_tokens_to_ids
    extra = {
        "vision_config": {
            "image_size": 32,
            "patch_size": tiny_qwen.PATCH_SIZE,
            "spatial_merge_size": tiny_qwen.MERGE_SIZE,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
        },
        # the multimodal RoPE axes (sequence, height, width) over the rotary half of head_dim 16
        "text_config": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                "partial_rotary_factor": 0.5}
        },
        "image_token_id": ids("<|image|>"),
        "video_token_id": ids("<|video|>"),
        "image_start_token_id": ids("<|begin_of_image|>"),
        "image_end_token_id": ids("<|end_of_image|>"),
        "video_start_token_id": ids("<|begin_of_video|>"),
        "video_end_token_id": ids("<|end_of_video|>"),
    }  # fmt: skip
    _save_generic(model_type, target, tokenizer, processor, extra)


def build_video_llava(target: Path) -> None:
    """Video-LLaVA: the tiny LLaVA's tokenizer, template and CLIP sizes (16 `<image>` tokens per 32 x 32 image) with
    a `<video>` token and a video processor (torchvision)."""
    from transformers import VideoLlavaImageProcessor, VideoLlavaProcessor, VideoLlavaVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm.llava import (
        IMAGE_SEQ_LENGTH,
        IMAGE_SIZE,
        IMAGE_TOKEN,
        LLAVA_CHAT_TEMPLATE,
        PATCH_SIZE,
    )

    tokenizer = build_tiny_tokenizer(chat_template=LLAVA_CHAT_TEMPLATE, image_token=IMAGE_TOKEN, video_token="<video>")
    sizes = {"size": {"shortest_edge": IMAGE_SIZE}, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    processor = VideoLlavaProcessor(
        image_processor=VideoLlavaImageProcessor(**sizes),
        video_processor=VideoLlavaVideoProcessor(**sizes),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    extra = {
        "vision_config": {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE},
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "video_token_index": tokenizer.convert_tokens_to_ids("<video>"),
        "image_seq_length": IMAGE_SEQ_LENGTH,
    }
    _save_generic("video_llava", target, tokenizer, processor, extra)


def build_llama4(target: Path) -> None:
    """Llama 4: one 32 x 32 tile per image (8 px patches, pixel-shuffled 2 x 2: 4 `<|patch|>` tokens between
    `<|image_start|>` and `<|image_end|>`); its image processor is a torchvision class."""
    from transformers import Llama4ImageProcessor, Llama4Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ("<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>")
    template = _chatml_template("<|image|>")
    tokenizer = build_tiny_tokenizer(extra_special_tokens=markers, chat_template=template, image_token="<|image|>")
    image_processor = Llama4ImageProcessor(size={"height": 32, "width": 32}, max_patches=1, resize_to_max_canvas=False)
    processor = Llama4Processor(
        image_processor, tokenizer, patch_size=8, pixel_shuffle_ratio=0.5, chat_template=template
    )
    extra = {
        # the pixel shuffle turns 4 patches of width 64 into one of 256, which the vision MLP takes in
        "vision_config": {"image_size": 32, "patch_size": 8, "intermediate_size": 256, "vision_output_dim": 64,
                          "projector_input_dim": 64, "projector_output_dim": 64, "pixel_shuffle_ratio": 0.5},
        "image_token_index": tokenizer.convert_tokens_to_ids("<|patch|>"),
    }  # fmt: skip
    _save_generic("llama4", target, tokenizer, processor, extra)


def build_lfm2_vl(target: Path) -> None:
    """LFM2-VL: a SigLIP2 NaFlex tower (8 px patches) pixel-unshuffled 2 x 2, one 32 x 32 view per image (no tiles):
    4 `<image>` tokens between `<|image_start|>` and `<|image_end|>`; its image processor is a torchvision class."""
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {
        "image_token": "<image>",
        "image_start_token": "<|image_start|>",
        "image_end_token": "<|image_end|>",
        "image_thumbnail_token": "<|img_thumbnail|>",
    }
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = Lfm2VlImageProcessor(
        do_image_splitting=False,
        use_thumbnail=False,
        encoder_patch_size=8,
        tile_size=32,
        min_image_tokens=4,
        max_image_tokens=4,
        downsample_factor=2,
    )
    processor = Lfm2VlProcessor(image_processor, tokenizer, chat_template=template)
    extra = {
        "vision_config": {"patch_size": 8, "num_patches": 16, "vision_use_head": False},
        "projector_hidden_size": 64,
        "downsample_factor": 2,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
    }
    _save_generic("lfm2_vl", target, tokenizer, processor, extra)


def build_cohere2_vision(target: Path) -> None:
    """Command A Vision: a SigLIP tower (32 x 32 tiles, 8 px patches) pixel-shuffled 2 x 2, so a tile gives 4
    `<|IMG_PATCH|>` tokens and a line break between the image markers; its image processor is a torchvision class
    (its `patch_size` counts merged patches per tile side)."""
    from transformers import Cohere2VisionImageProcessor, Cohere2VisionProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {
        "boi_token": "<|START_OF_IMG|>",
        "eoi_token": "<|END_OF_IMG|>",
        "image_token": "<|IMG_PATCH|>",
        "img_line_break_token": "<|IMG_LINE_BREAK|>",
    }
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = Cohere2VisionImageProcessor(size={"height": 32, "width": 32}, crop_to_patches=False, patch_size=2)
    processor = Cohere2VisionProcessor(image_processor, tokenizer, chat_template=template)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "downsample_factor": 2,
        "alignment_intermediate_size": 64,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
    }
    _save_generic("cohere2_vision", target, tokenizer, processor, extra)


def _tiny_qwen_patches() -> dict[str, int]:
    """The tiny Qwen-VL patch sizes, as Qwen2-VL's image and video processors take them."""
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    return {
        "patch_size": tiny_qwen.PATCH_SIZE,
        "merge_size": tiny_qwen.MERGE_SIZE,
        "temporal_patch_size": tiny_qwen.TEMPORAL_PATCH_SIZE,
        "min_pixels": tiny_qwen.MIN_PIXELS,
        "max_pixels": tiny_qwen.MAX_PIXELS,
    }


def _qwen2_vl_processor(processor_class: type) -> tuple[Any, Any]:
    """The tiny Qwen-VL tokenizer and a `processor_class` built as Qwen2-VL's processor is (image processor, tokenizer,
    video processor, template) at the tiny Qwen-VL sizes; the video processor needs torchvision."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLVideoProcessor

    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer = tiny_qwen.build_tokenizer()
    patches = _tiny_qwen_patches()
    processor = processor_class(
        Qwen2VLImageProcessorPil(**patches),
        tokenizer,
        Qwen2VLVideoProcessor(**patches),
        chat_template=tiny_qwen.CHAT_TEMPLATE,
    )
    return tokenizer, processor


def build_exaone4_5(target: Path) -> None:
    """EXAONE 4.5: Qwen2-VL's image and video processors and token layout (the tiny Qwen-VL tokenizer, template and
    sizes) with a Qwen2.5-VL-like windowed tower into an EXAONE 4 text model; the video processor needs torchvision."""
    from transformers import Exaone4_5_Processor

    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer, processor = _qwen2_vl_processor(Exaone4_5_Processor)
    extra = {
        "vision_config": {
            "depth": 2,
            "num_heads": 2,
            "patch_size": tiny_qwen.PATCH_SIZE,
            "spatial_merge_size": tiny_qwen.MERGE_SIZE,
            "temporal_patch_size": tiny_qwen.TEMPORAL_PATCH_SIZE,
            "window_size": 8,
            "fullatt_block_indexes": [1],
            "out_hidden_size": 64,
        },
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.IMAGE_PAD),
        "video_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.VIDEO_PAD),
    }
    _save_generic("exaone4_5", target, tokenizer, processor, extra)


def build_video_llama_3(target: Path) -> None:
    """VideoLLaMA 3: a SigLIP-like tower on 4 px patches (images unmerged: a 32 x 32 image gives 64 `<|image_pad|>`
    tokens) into a Qwen2, on the tiny Qwen-VL tokenizer and template; the video processor needs torchvision."""
    from transformers import VideoLlama3ImageProcessorPil, VideoLlama3Processor, VideoLlama3VideoProcessor

    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer = tiny_qwen.build_tokenizer()
    sizes = {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}
    processor = VideoLlama3Processor(
        VideoLlama3ImageProcessorPil(patch_size=tiny_qwen.PATCH_SIZE, merge_size=1, size=sizes),
        tokenizer,
        VideoLlama3VideoProcessor(patch_size=tiny_qwen.PATCH_SIZE, size=sizes),
        chat_template=tiny_qwen.CHAT_TEMPLATE,
    )
    extra = {
        "vision_config": {"patch_size": tiny_qwen.PATCH_SIZE},
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.IMAGE_PAD),
        "video_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.VIDEO_PAD),
    }
    _save_generic("video_llama_3", target, tokenizer, processor, extra)


def build_kimi_k25(target: Path) -> None:
    """Kimi K2.5: a MoonViT tower on 4 px patches merged 2 x 2 (a 32 x 32 image gives 16 `<|media_pad|>` tokens)
    into a DeepSeek-V3 text model; its image processor is a torchvision class."""
    from transformers import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ("<|media_begin|>", "<|media_content|>", "<|media_end|>")
    template = _chatml_template("<|media_begin|>image<|media_content|><|media_pad|><|media_end|>")
    tokenizer = build_tiny_tokenizer(
        extra_special_tokens=markers,
        chat_template=template,
        image_token="<|media_pad|>",
        video_token="<|kimi_k25_video_placeholder|>",
    )
    patches = {"patch_size": 4, "merge_kernel_size": 2, "size": {"max_height": 32, "max_width": 32}}
    processor = Kimi_K25Processor(
        Kimi_K25ImageProcessor(**patches), tokenizer, Kimi_K25VideoProcessor(**patches), chat_template=template
    )
    ids = tokenizer.convert_tokens_to_ids
    extra = {
        "vision_config": {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "merge_kernel_size": [2, 2]},
        "projection_hidden_size": 64,
        "image_token_id": ids("<|media_pad|>"),
        "video_token_id": ids("<|kimi_k25_video_placeholder|>"),
        "vision_start_token_id": ids("<|media_begin|>"),
        "vision_end_token_id": ids("<|media_end|>"),
    }
    _save_generic("kimi_k25", target, tokenizer, processor, extra)


def build_cohere_compass(target: Path) -> None:
    """Cohere Compass: a Qwen3-VL-like tower (4 px patches merged 2 x 2, DeepStack features) into a Cohere 2 text
    model, with `<|IMAGE_PAD|>` tokens between `<|VISION_START|>` and `<|VISION_END|>`, on the tiny tokenizer; its
    processor always carries a video processor (torchvision)."""
    from transformers import CohereCompassImageProcessorPil, CohereCompassProcessor, CohereCompassVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    markers = ("<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>")
    tokenizer = build_tiny_tokenizer(
        extra_special_tokens=markers, chat_template=_chatml_template("<|VISION_START|><|IMAGE_PAD|><|VISION_END|>")
    )
    patches = {"patch_size": tiny_qwen.PATCH_SIZE, "merge_size": tiny_qwen.MERGE_SIZE, "temporal_patch_size": 2}
    sizes = {"shortest_edge": tiny_qwen.MIN_PIXELS, "longest_edge": tiny_qwen.MAX_PIXELS}
    processor = CohereCompassProcessor(
        CohereCompassImageProcessorPil(size=sizes, **patches),
        tokenizer,
        CohereCompassVideoProcessor(size=sizes, **patches),
        chat_template=tokenizer.chat_template,
    )
    ids = tokenizer.convert_tokens_to_ids
    extra = {
        "vision_config": {
            "depth": 2,
            "num_heads": 2,
            "patch_size": tiny_qwen.PATCH_SIZE,
            "spatial_merge_size": tiny_qwen.MERGE_SIZE,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
            "out_hidden_size": 64,
        },
        # rotary settings per layer type, the multimodal axes (sequence, height, width) summing to head_dim / 2
        "text_config": {
            "rope_parameters": {
                kind: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
                for kind in ("full_attention", "sliding_attention")
            }
        },
        "image_token_id": ids("<|IMAGE_PAD|>"),
        "video_token_id": ids("<|VIDEO_PAD|>"),
        "vision_start_token_id": ids("<|VISION_START|>"),
        "vision_end_token_id": ids("<|VISION_END|>"),
    }
    _save_generic("cohere_compass", target, tokenizer, processor, extra)


def build_ernie4_5_vl_moe(target: Path) -> None:
    """ERNIE 4.5 VL: Qwen-VL-like patches at the tiny Qwen-VL sizes (4 px, merged 2 x 2) between image start and end
    tokens into a MoE text model with text and vision experts; its processor always carries a video processor
    (torchvision)."""
    from transformers import Ernie4_5_VLMoeImageProcessorPil, Ernie4_5_VLMoeProcessor, Ernie4_5_VLMoeVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    named = {
        "image_token": "<|IMAGE_PLACEHOLDER|>",
        "image_start_token": "<|IMAGE_START|>",
        "image_end_token": "<|IMAGE_END|>",
        "video_token": "<|VIDEO_PLACEHOLDER|>",
        "video_start_token": "<|VIDEO_START|>",
        "video_end_token": "<|VIDEO_END|>",
    }
    template = _chatml_template("<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>")
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    patches = {"patch_size": tiny_qwen.PATCH_SIZE, "merge_size": tiny_qwen.MERGE_SIZE}
    sizes = {"shortest_edge": tiny_qwen.MIN_PIXELS, "longest_edge": tiny_qwen.MAX_PIXELS}
    processor = Ernie4_5_VLMoeProcessor(
        Ernie4_5_VLMoeImageProcessorPil(size=sizes, **patches),
        tokenizer,
        Ernie4_5_VLMoeVideoProcessor(size=sizes, draw_on_frames=False, **patches),  # no timestamp font offline
        chat_template=template,
    )
    extra = {
        "vision_config": {
            "depth": 2,
            "num_heads": 2,
            "patch_size": tiny_qwen.PATCH_SIZE,
            "spatial_merge_size": tiny_qwen.MERGE_SIZE,
        },
        # text and vision experts' widths; the multimodal RoPE's (height, width, time) split of head_dim / 2
        "text_config": {
            "moe_intermediate_size": [32, 32],
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]},
        },
        **{f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in named.items()},
    }
    _save_generic("ernie4_5_vl_moe", target, tokenizer, processor, extra)


def build_aria(target: Path) -> None:
    """Aria: an Idefics3-style tower whose patches a cross-attention projector reads into a fixed number of query
    tokens per crop. The image processor only takes 490 or 980 px crops, so the tower's patches are 70 px (7 x 7 or
    14 x 14 patches), each mapped to 4 queries: 4 `<|img|>` tokens per image."""
    from transformers import AriaImageProcessorPil, AriaProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<|img|>")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<|img|>")
    image_processor = AriaImageProcessorPil(max_image_size=490, min_image_size=70)
    sizes = {490: 4, 980: 4}  # crop side -> tokens per crop, whichever side the processor's defaults pick
    processor = AriaProcessor(image_processor, tokenizer, chat_template=template, size_conversion=sizes)
    extra = {
        "vision_config": {"image_size": 980, "patch_size": 70},
        "projector_patch_to_query_dict": {49: 4, 196: 4},
        "image_token_index": tokenizer.convert_tokens_to_ids("<|img|>"),
    }
    _save_generic("aria", target, tokenizer, processor, extra)


def build_janus(target: Path) -> None:
    """Janus: a SigLIP tower (32 x 32 images, 8 px patches: 16 image tokens between `<begin_of_image>` and
    `<end_of_image>`) for understanding, and a VQ-VAE (shrunk to two levels) for image generation."""
    from transformers import JanusImageProcessorPil, JanusProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"}
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = JanusImageProcessorPil(size={"height": 32, "width": 32})
    processor = JanusProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=16)
    vq = {  # the generation head's VQ-VAE: two levels of 32 channels (its group norms take 32 groups), not five
        "base_channels": 32,
        "channel_multiplier": [1, 2],
        "num_res_blocks": 1,
        "latent_channels": 32,
        "num_embeddings": 64,
        "projection_dim": 64,
        "image_token_embed_dim": 64,
    }
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8, "num_image_tokens": 16, "projection_dim": 64},
        "vq_config": vq,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
    }
    _save_generic("janus", target, tokenizer, processor, extra)


def build_chameleon(target: Path) -> None:
    """Chameleon: a VQ-VAE turns each 32 x 32 image into 4 x 4 = 16 codebook entries, each written as its own token
    (`IMGIMG<digits as letters>Z`, 64 of them in the tokenizer) that the text model reads like any other; the
    processor expands `<image>` into 16 placeholders between `<racm3:break>` and `<eoss>`."""
    from transformers import ChameleonImageProcessorPil, ChameleonProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    codes = 64
    letters = str.maketrans("0123456789", "ABCDEFGHIJ")
    image_tokens = [f"IMGIMG{str(code).translate(letters)}Z" for code in range(codes)]
    template = _chatml_template("<image>")
    named = {"image_token": "<image>", "boi_token": "<racm3:break>", "eoi_token": "<eoss>"}
    tokenizer = build_tiny_tokenizer(extra_special_tokens=image_tokens, chat_template=template, **named)
    size = {"shortest_edge": 32}
    image_processor = ChameleonImageProcessorPil(size=size, crop_size={"height": 32, "width": 32})
    processor = ChameleonProcessor(image_processor, tokenizer, image_seq_length=16)
    processor.chat_template = template
    vq = {  # four levels (three halvings: 32 px -> 4 x 4) of 32 channels, its group norms taking 32 groups
        "resolution": 32,
        "base_channels": 32,
        "channel_multiplier": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "latent_channels": 32,
        "embed_dim": 32,
        "num_embeddings": codes,
    }
    extra = {"vq_config": vq, "vocabulary_map": tokenizer.get_vocab()}
    _save_generic("chameleon", target, tokenizer, processor, extra)


def build_emu3(target: Path) -> None:
    """Emu3: a VQ-VAE turns each 32 x 32 image into 4 x 4 codes (three halvings), written as `<|visual token N|>`
    tokens (64 in the tokenizer) with an end-of-line token after each row: 20 image tokens between the processor's
    image markers."""
    from transformers import Emu3ImageProcessor, Emu3Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    codes = 64
    visual = [f"<|visual token {code:06d}|>" for code in range(codes)]
    named = {
        "image_token": "<image>",
        "boi_token": "<|image start|>",
        "eoi_token": "<|image end|>",
        "image_wrapper_token": "<|image token|>",
        "eof_token": "<|extra_201|>",
    }
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(extra_special_tokens=[*visual, "<|extra_200|>"], chat_template=template, **named)
    image_processor = Emu3ImageProcessor(min_pixels=32 * 32, max_pixels=32 * 32, spatial_factor=8)
    processor = Emu3Processor(image_processor, tokenizer, chat_template=template)
    vq = {  # four levels of 32 channels (its group norms take 32 groups); the middle attention runs at that width
        "codebook_size": codes,
        "hidden_size": 32,
        "base_channels": 32,
        "channel_multiplier": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "attn_resolutions": [],
    }
    extra = {"vq_config": vq, "vocabulary_map": tokenizer.get_vocab()}
    _save_generic("emu3", target, tokenizer, processor, extra)


def build_ovis2(target: Path) -> None:
    """Ovis2: an AIMv2-style tower (32 x 32 images, 8 px patches) whose 16 patches each become a probability over a
    visual vocabulary, embedded as 16 `<IMG_ATOM>` tokens between the processor's grid markers."""
    from transformers import Ovis2ImageProcessorPil, Ovis2Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    indicators = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
    template = _chatml_template("<image>")
    tokenizer = build_tiny_tokenizer(
        extra_special_tokens=["<IMG_ATOM>", *indicators], chat_template=template, image_token="<image>"
    )
    image_processor = Ovis2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    processor = Ovis2Processor(image_processor, tokenizer, chat_template=template, image_seq_length=16)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8, "vocab_size": 64},
        "image_token_id": tokenizer.convert_tokens_to_ids("<IMG_ATOM>"),
        "visual_indicator_token_ids": tokenizer.convert_tokens_to_ids(list(indicators)),
        "vocab_size": len(tokenizer),
    }
    _save_generic("ovis2", target, tokenizer, processor, extra)


def build_deepseek_vl_hybrid(target: Path) -> None:
    """DeepSeek-VL hybrid: DeepSeek-VL's SigLIP tower (32 x 32 images, 8 px patches: 16 `<image_placeholder>`
    tokens) beside a SAM tower reading the same image at 64 x 64 (16 px patches), its features resized onto the
    SigLIP grid."""
    from transformers import DeepseekVLHybridImageProcessorPil, DeepseekVLHybridProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<image_placeholder>")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<image_placeholder>")
    image_processor = DeepseekVLHybridImageProcessorPil(
        size={"height": 32, "width": 32}, high_res_size={"height": 64, "width": 64}
    )
    processor = DeepseekVLHybridProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=16)
    sam = {  # two layers, the second with global attention, and narrow output channels
        "image_size": 64,
        "patch_size": 16,
        "output_channels": 32,
        "mlp_dim": 64,
        "window_size": 2,
        "global_attn_indexes": [1],
    }
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "high_res_vision_config": sam,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image_placeholder>"),
    }
    _save_generic("deepseek_vl_hybrid", target, tokenizer, processor, extra)


def build_gemma3n(target: Path) -> None:
    """Gemma 3n: a timm tower (timm's `test_convnext` in place of MobileNetV5: a 64 x 64 image gives 2 x 2 features of
    64 channels, so 4 soft tokens per image) and an audio tower beside the text model. Its token layout puts the image
    and audio tokens in two ranges after the text-only ids (each embedded by its own table), so the tokenizer's
    special tokens come in that order: text-only markers, then the image range, then the audio range."""
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nProcessor, SiglipImageProcessorPil

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"boi_token": "<start_of_image>", "boa_token": "<start_of_audio>"}
    image_range = {"eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    audio_range = {"eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
    ordered = [*named.values(), *image_range.values(), "<image_unused>", *audio_range.values(), "<audio_unused>"]
    template = _chatml_template(image_range["image_token"])  # what the processor expands, markers included
    tokenizer = build_tiny_tokenizer(ordered, chat_template=template, **named, **image_range, **audio_range)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in {**image_range, **audio_range}.items()}
    image_processor = SiglipImageProcessorPil(size={"height": 64, "width": 64})
    processor = Gemma3nProcessor(
        Gemma3nAudioFeatureExtractor(), image_processor, tokenizer, chat_template=template, image_seq_length=4
    )
    extra = {
        "vision_config": {"architecture": "test_convnext", "hidden_size": 64, "vocab_size": 3},
        "audio_config": {"vocab_size": 3, "vocab_offset": ids["eoa_token"]},
        "text_config": {"vocab_size_per_layer_input": ids["eoi_token"]},
        "vision_soft_tokens_per_image": 4,
        "boi_token_id": tokenizer.convert_tokens_to_ids(named["boi_token"]),
        "boa_token_id": tokenizer.convert_tokens_to_ids(named["boa_token"]),
        **{f"{name[:-6]}_token_id": token_id for name, token_id in ids.items()},
    }
    extra["vision_config"]["vocab_offset"] = ids["eoi_token"]
    _save_generic("gemma3n", target, tokenizer, processor, extra)


def build_fuyu(target: Path) -> None:
    """Fuyu: no vision tower, each 8 x 8 patch of a 32 x 32 image is projected straight into the text model: a 4 x 4
    grid of `|SPEAKER|` tokens, each row ended by `|NEWLINE|`. The processor itself puts the image before the text
    and appends the `<0x04>` answer marker; the template writes the image where the row has it."""
    from transformers import FuyuImageProcessorPil, FuyuProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("|SPEAKER|")
    tokenizer = build_tiny_tokenizer(["|SPEAKER|", "|NEWLINE|", "<s>", "<0x04>"], chat_template=template)
    image_processor = FuyuImageProcessorPil(size={"height": 32, "width": 32}, patch_size={"height": 8, "width": 8})
    processor = FuyuProcessor(image_processor, tokenizer)
    processor.chat_template = template
    extra = {"image_size": 32, "patch_size": 8, "image_token_id": tokenizer.convert_tokens_to_ids("|SPEAKER|")}
    _save_generic("fuyu", target, tokenizer, processor, extra)


def build_got_ocr2(target: Path) -> None:
    """GOT-OCR2: a SAM tower whose 64 x 64 patch grid two strided convolutions fold to 16 x 16 = 256 image tokens.
    transformers does not save the processor's `num_image_tokens`, so a saved `GotOcr2Processor` always expands
    `<imgpad>` 256 times: the tower is sized to give that (64 x 64 images, 1 px patches), and the rows get a longer
    `sequence_len` (`VLM_SEQUENCE_LEN`)."""
    from transformers import GotOcr2ImageProcessorPil, GotOcr2Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<img><imgpad></img>")
    tokenizer = build_tiny_tokenizer(["<img>", "</img>"], chat_template=template, image_token="<imgpad>")
    image_processor = GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}, crop_to_patches=False)
    processor = GotOcr2Processor(image_processor, tokenizer, chat_template=template)
    sam = {  # two layers, the second with global attention, 8 x 8 windows
        "image_size": 64,
        "patch_size": 1,
        "output_channels": 32,
        "mlp_dim": 64,
        "window_size": 8,
        "global_attn_indexes": [1],
    }
    extra = {
        "vision_config": sam,
        "image_seq_length": 256,
        "image_token_index": tokenizer.convert_tokens_to_ids("<imgpad>"),
    }
    _save_generic("got_ocr2", target, tokenizer, processor, extra)


def build_perception_lm(target: Path) -> None:
    """PerceptionLM: a timm ViT (timm's `test_vit` at 32 px: 2 x 2 patches of 16 px and a class token, dropped) in
    place of its Perception Encoder, one 32 px tile per image (`vanilla`), no pooling: 4 `<|image|>` tokens."""
    from transformers import PerceptionLMImageProcessor, PerceptionLMProcessor, PerceptionLMVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"image_token": "<|image|>", "video_token": "<|video|>"}
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = PerceptionLMImageProcessor(tile_size=32, max_num_tiles=1, vision_input_type="vanilla")
    processor = PerceptionLMProcessor(
        PerceptionLMVideoProcessor(), image_processor, tokenizer, patch_size=16, chat_template=template, pooling_ratio=1
    )
    vision = {"architecture": "test_vit", "model_args": {"embed_dim": 64, "img_size": 32}, "do_pooling": False}
    extra = {
        "vision_config": vision,
        "projector_pooling_ratio": 1,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
        "video_token_id": tokenizer.convert_tokens_to_ids(named["video_token"]),
    }
    _save_generic("perception_lm", target, tokenizer, processor, extra)


def build_lfm3_vl(target: Path) -> None:
    """LFM3-VL: a hybrid (convolution and attention layers) tower on Qwen2-VL-style patches, 8 px and merged 2 x 2: a
    32 x 32 image gives 4 `<|image_pad|>` tokens between `<|vision_start|>` and `<|vision_end|>`; its processor
    carries a Qwen2-VL video processor (torchvision)."""
    from transformers import Lfm3VlProcessor, Qwen2VLImageProcessorPil, Qwen2VLVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    }
    template = _chatml_template("<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    pixels = {"min_pixels": 32 * 32, "max_pixels": 32 * 32, "patch_size": 8, "merge_size": 2}
    image_processor = Qwen2VLImageProcessorPil(**pixels)
    processor = Lfm3VlProcessor(image_processor, tokenizer, Qwen2VLVideoProcessor(**pixels), chat_template=template)
    extra = {
        "vision_config": {"patch_size": 8, "spatial_merge_size": 2, "layer_types": ["conv", "full_attention"]},
        "text_config": {"bos_token_id": None},  # its default lies outside the tiny vocabulary
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
        "video_token_id": tokenizer.convert_tokens_to_ids(named["video_token"]),
    }
    _save_generic("lfm3_vl", target, tokenizer, processor, extra)


def build_qianfan_ocr(target: Path) -> None:
    """Qianfan-OCR: InternVL's layout (an InternViT-style tower, 32 x 32 images, 8 px patches pixel-shuffled 2 x 2),
    its processor turning the template's `<image>` into 4 `<IMG_CONTEXT>` tokens between `<img>` and `</img>`; no
    video processor."""
    from transformers import GotOcr2ImageProcessorPil, QianfanOCRProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}
    template = _chatml_template("<image>")
    tokenizer = build_tiny_tokenizer(["<image>"], chat_template=template, **named)
    image_processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    processor = QianfanOCRProcessor(image_processor, tokenizer, image_seq_length=4, chat_template=template)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 8},
        "image_seq_length": 4,
        "downsample_ratio": 0.5,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["context_image_token"]),
    }
    _save_generic("qianfan_ocr", target, tokenizer, processor, extra)


def build_pp_chart2table(target: Path) -> None:
    """PP-Chart2Table: GOT-OCR2's model behind a processor that expands nothing, so the template writes all the image
    tokens itself: a SAM tower (32 x 32 images, 2 px patches, folded to 4 x 4) and 16 `<imgpad>` between `<img>` and
    `</img>`."""
    from transformers import PPChart2TableImageProcessorPil, PPChart2TableProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<img>" + "<imgpad>" * 16 + "</img>")
    tokenizer = build_tiny_tokenizer(["<img>", "</img>", "<imgpad>"], chat_template=template)
    image_processor = PPChart2TableImageProcessorPil(size={"height": 32, "width": 32})
    processor = PPChart2TableProcessor(image_processor, tokenizer, chat_template=template)
    sam = {"image_size": 32, "patch_size": 2, "output_channels": 32, "mlp_dim": 64, "window_size": 4}
    extra = {
        "vision_config": {**sam, "global_attn_indexes": [1]},
        "image_seq_length": 16,
        "image_token_index": tokenizer.convert_tokens_to_ids("<imgpad>"),
    }
    _save_generic("pp_chart2table", target, tokenizer, processor, extra)


def build_granite4_vision(target: Path) -> None:
    """Granite 4 Vision: LLaVA-NeXT's any-resolution tiles of 32 x 32 (`build_llava_next`'s sizes) through a CLIP
    tower of 4 px patches (8 x 8 per tile, the class token dropped), whose window Q-Former projectors halve each side
    (`downsample_rate` 1/2: 4 x 4 per tile) and inject features of two tower layers into the two text layers
    (deepstack) besides the four spatial-offset groups."""
    from transformers import Granite4VisionProcessor

    from hellbender.models.tiny_vlm.llava import IMAGE_SIZE, IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    patch, rate = 4, "1/2"
    image_processor = _llava_next_tiles()
    processor = Granite4VisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        downsample_rate=rate,
    )
    extra = {
        # the Q-Former's width is the tower's, one head per 64 channels
        "vision_config": {"image_size": IMAGE_SIZE, "patch_size": patch, "hidden_size": 64},
        "qformer_config": {"intermediate_size": 64},
        "image_grid_pinpoints": image_processor.image_grid_pinpoints,
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "downsample_rate": rate,
        "deepstack_layer_map": [[0, 0], [1, 1]],  # [tower layer, text layer]
        "spatial_target_layers": [0, 1, 0, 1],
    }
    _save_generic("granite4_vision", target, tokenizer, processor, extra)


def build_hyperclovax_vision_v2(target: Path) -> None:
    """HyperCLOVA X Vision V2: a Qwen2.5-VL tower at the tiny Qwen-VL sizes (4 px patches merged 2 x 2, windowed
    block 0, full block 1) into a HyperCLOVA X text model; its processor expands `<|image_pad|>` per merged patch and
    always carries a Qwen2-VL video processor (torchvision)."""
    from transformers import HyperCLOVAXVisionV2Processor

    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer, processor = _qwen2_vl_processor(HyperCLOVAXVisionV2Processor)
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": tiny_qwen.PATCH_SIZE,
        "spatial_merge_size": tiny_qwen.MERGE_SIZE,
        "temporal_patch_size": tiny_qwen.TEMPORAL_PATCH_SIZE,
        "window_size": tiny_qwen.PATCH_SIZE * tiny_qwen.MERGE_SIZE,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 64,
    }
    extra = {
        "vision_config": vision,
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.IMAGE_PAD),
        "video_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.VIDEO_PAD),
    }
    _save_generic("hyperclovax_vision_v2", target, tokenizer, processor, extra)


def build_dots3_note(target: Path) -> None:
    """Dots 3 Note: a MoE vision tower on Qwen2-VL-style patches (4 px, merged 2 x 2, no temporal patch) whose adapter
    feeds the Dots 3 text model: a 32 x 32 image gives 16 `<|imgpad|>` tokens; its processor carries a Qwen3-VL video
    processor (torchvision) and an audio feature extractor beside the Qwen2-VL image processor."""
    from transformers import (
        Dots3NoteFeatureExtractor,
        Dots3NoteProcessor,
        Qwen2VLImageProcessorPil,
        Qwen3VLVideoProcessor,
    )

    from hellbender.models.tiny import build_tiny_tokenizer

    named = ("<|imgpad|>", "<|video_pad|>", "<|audio_comp_pad|>")  # what the processor expands, by these names
    template = _chatml_template(named[0])
    tokenizer = build_tiny_tokenizer(list(named), chat_template=template)
    pixels = {"min_pixels": 32 * 32, "max_pixels": 32 * 32, "patch_size": 4, "merge_size": 2}
    processor = Dots3NoteProcessor(
        Qwen2VLImageProcessorPil(**pixels, temporal_patch_size=1),
        tokenizer,
        Qwen3VLVideoProcessor(**pixels),
        Dots3NoteFeatureExtractor(),
        chat_template=template,
    )
    ids = tokenizer.convert_tokens_to_ids(list(named))
    extra = {
        "vision_config": {"patch_size": 4, "spatial_merge_size": 2},
        "text_config": {"bos_token_id": None},  # its default lies outside the tiny vocabulary
        "image_token_id": ids[0],
        "video_token_id": ids[1],
        "audio_token_id": ids[2],
    }
    _save_generic("dots3_note", target, tokenizer, processor, extra)


def _qwen_layout(model_type: str, prefix: str, *, temporal_patch_size: int = 1) -> tuple[Any, Any]:
    """The tiny Qwen-VL tokenizer and `model_type`'s own `{prefix}Processor` on Qwen-VL-style patches at the tiny
    Qwen-VL sizes (4 px, merged 2 x 2, a 32 x 32 image at most: 16 patches, 4 `<|image_pad|>` tokens), with its own
    image processor and its video processor (torchvision)."""
    import transformers

    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer = tiny_qwen.build_tokenizer()
    patches = {
        "patch_size": tiny_qwen.PATCH_SIZE,
        "merge_size": tiny_qwen.MERGE_SIZE,
        "temporal_patch_size": temporal_patch_size,
        "size": {"shortest_edge": tiny_qwen.MIN_PIXELS, "longest_edge": tiny_qwen.MAX_PIXELS},
    }
    image_processor = getattr(transformers, f"{prefix}ImageProcessorPil")(**patches)
    video_processor = getattr(transformers, f"{prefix}VideoProcessor")(**patches)
    processor = getattr(transformers, f"{prefix}Processor")(
        image_processor, tokenizer, video_processor, chat_template=tiny_qwen.CHAT_TEMPLATE
    )
    return tokenizer, processor


def build_cosmos3_edge(target: Path) -> None:
    """Cosmos3 Edge: a SigLIP-like tower on Qwen-VL-style patches (`_qwen_layout`: 4 px, merged 2 x 2) into a text
    model with multimodal RoPE."""
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer, processor = _qwen_layout("cosmos3_edge", "Cosmos3Edge")
    extra = {
        "vision_config": {"patch_size": tiny_qwen.PATCH_SIZE, "spatial_merge_size": tiny_qwen.MERGE_SIZE},
        "text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        **tiny_qwen.token_ids(
            dict(
                zip(
                    tiny_qwen.VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(tiny_qwen.VISION_TOKENS)), strict=True
                )
            )
        ),
    }
    _save_generic("cosmos3_edge", target, tokenizer, processor, extra)


def build_glm5_next(target: Path) -> None:
    """GLM-5 Next: GLM-4V's layout (`build_glm4v`'s tokenizer and template: `<|image|>` per merged patch between
    `<|begin_of_image|>` and `<|end_of_image|>`) on its own image and video processors (torchvision), 4 px patches
    merged 2 x 2, at most 4 image tokens, into its hybrid (linear and indexed attention) MoE text model."""
    from transformers import Glm5NextImageProcessorPil, Glm5NextProcessor, Glm5NextVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>")
    template = _chatml_template("<|begin_of_image|><|image|><|end_of_image|>")
    tokenizer = build_tiny_tokenizer(
        extra_special_tokens=markers, chat_template=template, image_token="<|image|>", video_token="<|video|>"
    )
    patches = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}
    image_processor = Glm5NextImageProcessorPil(min_image_tokens=1, max_image_tokens=4, **patches)
    processor = Glm5NextProcessor(image_processor, tokenizer, Glm5NextVideoProcessor(**patches), chat_template=template)
    ids = tokenizer.convert_tokens_to_ids
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                          "projection_intermediate_size": 128},
        # its indexed attention layers have no rotary part (the default's 0, which the generic shrink would set)
        "text_config": {"qk_rope_head_dim": 0, "head_dim": 0},
        "image_token_id": ids("<|image|>"),
        "video_token_id": ids("<|video|>"),
        "image_start_token_id": ids("<|begin_of_image|>"),
        "image_end_token_id": ids("<|end_of_image|>"),
        "video_start_token_id": ids("<|begin_of_video|>"),
        "video_end_token_id": ids("<|end_of_video|>"),
    }  # fmt: skip
    _save_generic("glm5_next", target, tokenizer, processor, extra)


def build_hy_v4_vl(target: Path) -> None:
    """HY V4 VL: Qwen-VL-style patches (`_qwen_layout`: 4 px, merged 2 x 2, no temporal patch), one token per merged
    patch plus one per merged row (`<|image_pad|>` throughout), into a latent-attention MoE text model whose
    multimodal RoPE sections cover its rotary half."""
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    tokenizer, processor = _qwen_layout("hy_v4_vl", "HYV4VL")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}  # sum: qk_rope_head_dim / 2
    extra = {
        "vision_config": {
            "patch_size": tiny_qwen.PATCH_SIZE,
            "spatial_merge_size": tiny_qwen.MERGE_SIZE,
            "out_hidden_size": 64,
        },
        "text_config": {"rope_parameters": rope, "bos_token_id": None},
        "image_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.IMAGE_PAD),
        "video_token_id": tokenizer.convert_tokens_to_ids(tiny_qwen.VIDEO_PAD),
    }
    _save_generic("hy_v4_vl", target, tokenizer, processor, extra)


def build_deepseek_ocr2(target: Path) -> None:
    """DeepSeek-OCR-2: a SAM tower (192 x 192 images, 4 px patches: 48 x 48, windowed, one global layer) whose two
    strided convolutions fold it to 12 x 12, read by a causal encoder through its 144 learned queries (the model's
    768 px query set, the count at this grid), so each image gives 144 `<image>` tokens and a view separator. One
    global view per image (no local tiles); the rows get a longer `sequence_len` (`VLM_SEQUENCE_LEN`)."""
    from transformers import DeepseekOcr2ImageProcessorPil, DeepseekOcr2Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<image>")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<image>")
    image_processor = DeepseekOcr2ImageProcessorPil(size={"height": 192, "width": 192}, crop_to_patches=False)
    processor = DeepseekOcr2Processor(image_processor, tokenizer, chat_template=template, patch_size=4)
    sam = {
        "image_size": 192,
        "patch_size": 4,
        "output_channels": 32,
        "mlp_dim": 64,
        "window_size": 8,
        "global_attn_indexes": [1],
        "downsample_channels": [32, 64],  # the last is the encoder's width
    }
    vision = _shrunk_composite(
        "deepseek_ocr2", "vision_config", tokenizer, {"sam_config": sam, "encoder_config": {"vocab_size": 16}}
    )
    extra = {
        "vision_config": vision,
        # the default leaves the dense / MoE pattern to a checkpoint; its model reads one per layer
        "text_config": {"mlp_layer_types": ["dense", "sparse"]},
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
    }
    _save_generic("deepseek_ocr2", target, tokenizer, processor, extra)


def build_gemma4_unified(target: Path) -> None:
    """Gemma 4 Unified: no vision tower, each image's 4 px patches are embedded and pooled 3 x 3 straight into the
    text model (at most 70 soft tokens, as the tiny Gemma 4); the tiny Gemma 4's tokenizer and template, its own
    image and video processors (torchvision) and audio feature extractor."""
    from transformers import (
        Gemma4UnifiedAudioFeatureExtractor,
        Gemma4UnifiedImageProcessor,
        Gemma4UnifiedProcessor,
        Gemma4UnifiedVideoProcessor,
    )

    from hellbender.models.tiny_vlm import gemma4 as tiny

    tokenizer = tiny.build_tokenizer()
    extra_special_tokens = list(tokenizer.extra_special_tokens)
    patches = {"patch_size": tiny.PATCH_SIZE, "pooling_kernel_size": tiny.POOLING_KERNEL_SIZE}
    processor = Gemma4UnifiedProcessor(
        Gemma4UnifiedAudioFeatureExtractor(),
        Gemma4UnifiedImageProcessor(max_soft_tokens=tiny.MAX_SOFT_TOKENS, **patches),
        tokenizer,
        Gemma4UnifiedVideoProcessor(**patches),
        chat_template=tiny.GEMMA4_CHAT_TEMPLATE,
        image_seq_length=tiny.MAX_SOFT_TOKENS,
    )
    # its __init__ replaces the tokenizer's extra special tokens with `<|video|>` (as Gemma 4's does): put them back
    tokenizer.add_special_tokens({"extra_special_tokens": extra_special_tokens})
    ids = tokenizer.convert_tokens_to_ids
    extra = {
        "vision_config": {**patches, "mm_embed_dim": 64, "mm_posemb_size": tiny.POSITION_EMBEDDING_SIZE,
                          "output_proj_dims": 64},
        "image_token_id": ids(tiny.IMAGE_TOKEN),
        "boi_token_id": ids(tiny.BOI_TOKEN),
        "eoi_token_id": ids(tiny.EOI_TOKEN),
        "video_token_id": ids(tiny.VIDEO_TOKEN),
        "audio_token_id": ids(tiny.AUDIO_TOKEN),
        "boa_token_id": ids(tiny.BOA_TOKEN),
        "eoa_token_index": ids(tiny.EOA_TOKEN),
    }  # fmt: skip
    _save_generic("gemma4_unified", target, tokenizer, processor, extra)


def build_inkling2(target: Path, model_type: str = "inkling2") -> None:
    """Inkling 2 (and Inkling 2 Loop, the same layout): each 8 x 8 tile of an image (2 x 2 patches of 4 px) is one
    `<|image|>` token, so a 32 x 32 image gives 16; its image processor is a torchvision class."""
    from transformers import Inkling2ImageProcessor, Inkling2Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<|image|>")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<|image|>")
    image_processor = Inkling2ImageProcessor(size={"height": 8, "width": 8})
    processor = Inkling2Processor(image_processor, tokenizer, chat_template=template)
    extra = {
        "vision_config": {"patch_size": 4, "spatial_merge_size": 2, "posemb_grid_size": 8, "text_hidden_size": 64,
                          "projection_hidden_dim": 128},
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image|>"),
    }  # fmt: skip
    _save_generic(model_type, target, tokenizer, processor, extra)


def build_inkling(target: Path) -> None:
    """Inkling: each 8 x 8 patch of an image is one `<|image|>` token after a `<|content_image|>` marker (its image
    processor cuts one column more than the width holds, padded); an audio feature extractor beside its torchvision
    image processor. Its vision tower imports SciPy when built, so it is surveyed with SciPy importable."""
    from transformers import InklingFeatureExtractor, InklingImageProcessor, InklingProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = {"image_bos_token": "<|content_image|>", "audio_bos_token": "<|content_audio_input|>"}
    template = _chatml_template(markers["image_bos_token"] + "<|image|>")
    tokenizer = build_tiny_tokenizer(
        list(markers.values()), chat_template=template, image_token="<|image|>", audio_token="<|audio|>"
    )
    image_processor = InklingImageProcessor(size={"height": 8, "width": 8})
    processor = InklingProcessor(
        InklingFeatureExtractor(), image_processor, tokenizer, chat_template=template, **markers
    )
    ids = tokenizer.convert_tokens_to_ids
    extra = {
        "vision_config": {"patch_size": 8, "text_hidden_size": 64},
        "image_token_id": ids("<|image|>"),
        "audio_token_id": ids("<|audio|>"),
        "image_bos_token_id": ids(markers["image_bos_token"]),
        "audio_bos_token_id": ids(markers["audio_bos_token"]),
    }
    _save_generic("inkling_mm_model", target, tokenizer, processor, extra)


def build_apertus1p5(target: Path) -> None:
    """Apertus 1.5: images become discrete codes of a tiny IBQ tokenizer (4 stages: 8 x 8 downsampling, a codebook of
    16 whose codes sit in the vocabulary after the tiny tokenizer's own ids, followed by the audio codebook's 16);
    its processor writes each image as `<|boi|>H*W<|image_wrapper|>` and H rows of W `<|image|>` tokens split by
    `<|eol|>`, then `<|eoi|>` (a 32 x 32 image: 4 x 4). Its image processor is a torchvision class; a WavTokenizer
    feature extractor and encoder serve audio."""
    from transformers import Apertus1p5ImageProcessor, Apertus1p5Processor, WavTokenizerFeatureExtractor

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {
        "image_token": "<|image|>",
        "audio_token": "<|audio|>",
        "boi_token": "<|boi|>",
        "eoi_token": "<|eoi|>",
        "image_wrapper_token": "<|image_wrapper|>",
        "eol_token": "<|eol|>",
        "boa_token": "<|boa|>",
        "eoa_token": "<|eoa|>",
    }
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    image_processor = Apertus1p5ImageProcessor(size={"min_pixels": 32 * 32, "max_pixels": 32 * 32}, spatial_factor=8)
    processor = Apertus1p5Processor(image_processor, WavTokenizerFeatureExtractor(), tokenizer, chat_template=template)
    codes = 16  # per codebook (image, then audio), after the tokenizer's ids
    vision = {
        "codebook_size": codes,
        "embed_dim": 32,
        "latent_channels": 32,
        "base_channels": 32,
        "channel_multiplier": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "attn_resolutions": [],
        "resolution": 32,
    }
    audio = {"codebook_size": codes, "codebook_dim": 16, "hidden_size": 16, "num_filters": 4}
    extra = {
        "vision_config": vision,
        "audio_config": audio,
        "text_config": {"vocab_size": len(tokenizer) + 2 * codes},
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
        "audio_token_id": tokenizer.convert_tokens_to_ids(named["audio_token"]),
        "image_token_offset": len(tokenizer),
        "audio_token_offset": len(tokenizer) + codes,
    }  # fmt: skip
    _save_generic("apertus1p5", target, tokenizer, processor, extra)


def build_step3p7(target: Path) -> None:
    """Step 3.7: a ViT (32 x 32 images, 4 px patches) whose 8 x 8 patches two stride-2 convolutions fold to 2 x 2 = 4
    `<im_patch>` tokens between `<im_start>` and `<im_end>`; a 32 x 32 image fits the global view, so no local crops
    (and their `<patch_start>` groups) are added. Its text model builds a sliding-window mask whatever its layers are,
    so the config sets the window its checkpoints set (and one sliding layer, and one MoE layer after a dense one)."""
    from transformers import Step3p7ImageProcessor, Step3p7Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ["<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"]
    template = _chatml_template("<im_patch>")
    tokenizer = build_tiny_tokenizer([*markers, "<im_patch>"], chat_template=template)
    image_processor = Step3p7ImageProcessor(
        size={"height": 32, "width": 32}, patch_size=16, vision_patch_size=4, downsampler_stride=4
    )
    processor = Step3p7Processor(image_processor, tokenizer, chat_template=template)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 4, "max_position_embeddings": 64},
        "text_config": {
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "mlp_layer_types": ["dense", "sparse"],
        },
        "image_token_id": tokenizer.convert_tokens_to_ids("<im_patch>"),
    }
    _save_generic("step3p7", target, tokenizer, processor, extra)


def build_unlimited_ocr(target: Path) -> None:
    """Unlimited-OCR: DeepSeek-OCR's layout, a SAM tower (128 x 128 images, 16 px patches: 8 x 8, folded 4 x 4 by two
    strided convolutions to 2 x 2) read by a CLIP encoder, each row of features followed by a newline and the image by
    a view separator: 2 x (2 + 1) + 1 = 7 `<image>` tokens per image, no local tiles."""
    from transformers import UnlimitedOcrImageProcessor, UnlimitedOcrProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    template = _chatml_template("<image>")
    tokenizer = build_tiny_tokenizer(chat_template=template, image_token="<image>")
    image_processor = UnlimitedOcrImageProcessor(
        size={"height": 128, "width": 128}, tile_size=128, crop_to_patches=False
    )
    processor = UnlimitedOcrProcessor(image_processor, tokenizer, chat_template=template)
    sam = {
        "hidden_size": 32,
        "output_channels": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 128,
        "patch_size": 16,
        "window_size": 4,
        "global_attn_indexes": [1],
        "mlp_dim": 64,
        "downsample_channels": [32, 32],
    }
    encoder = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    extra = {
        "vision_config": {"sam_config": sam, "encoder_config": encoder},
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
    }
    _save_generic("unlimited_ocr", target, tokenizer, processor, extra)


def build_minicpmv(target: Path, model_type: str = "minicpmv4_6") -> None:
    """MiniCPM-V 4.6 and 4.7 (and MiniCPM-OCR): a SigLIP-style tower (4 px patches) whose 32 x 32 image (8 x 8
    patches) a 16x merger folds to 4 `<image_pad>` tokens (MiniCPM-OCR's 4x merger: 16) between `<image>` and
    `</image>`, after an `<image_id>` tag; a 32 x 32 image needs no slices. The processor reads every marker from the
    tokenizer's named tokens and always carries a video processor (torchvision)."""
    import transformers

    from hellbender.models.tiny import build_tiny_tokenizer

    named = {
        "image_token": "<image_pad>",
        "video_token": "<video_pad>",
        "image_start_token": "<image>",
        "image_end_token": "</image>",
        "slice_start_token": "<slice>",
        "slice_end_token": "</slice>",
        "image_id_start_token": "<image_id>",
        "image_id_end_token": "</image_id>",
    }
    template = _chatml_template(named["image_token"])
    tokenizer = build_tiny_tokenizer(chat_template=template, **named)
    sizes = {"scale_resolution": 32, "patch_size": 4, "max_slice_nums": 1}
    prefix = "MiniCPMOcr" if model_type == "minicpm_ocr" else "MiniCPMV4_6"  # MiniCPM-V 4.7 uses 4.6's processors
    image_processor = getattr(transformers, f"{prefix}ImageProcessor")(**sizes)
    video_processor = getattr(transformers, f"{prefix}VideoProcessor")(**sizes)
    stock = transformers.models.auto.processing_auto.PROCESSOR_MAPPING_NAMES[model_type]
    processor = getattr(transformers, stock)(image_processor, video_processor, tokenizer, chat_template=template)
    extra = {
        "vision_config": {"image_size": 32, "patch_size": 4, "num_hidden_layers": 2},
        "image_size": 32,
        "insert_layer_id": 0,
        "image_token_id": tokenizer.convert_tokens_to_ids(named["image_token"]),
        "video_token_id": tokenizer.convert_tokens_to_ids(named["video_token"]),
    }
    _save_generic(model_type, target, tokenizer, processor, extra)


def build_minimax_m3_vl(target: Path) -> None:
    """MiniMax M3 VL: Qwen-VL-style patches at the tiny Qwen-VL sizes (4 px, merged 2 x 2, at most 16 x 16 px: 4
    image tokens) between its bracketed image markers, into a MoE text model with a sparse-attention indexer layer
    (its checkpoints mix them with full attention; the default has none) and a dense layer before a MoE one."""
    from transformers import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen

    cls = MiniMaxM3VLProcessor
    markers = [cls.VISION_START_TOKEN, cls.VISION_END_TOKEN, cls.IMAGE_TOKEN, cls.VIDEO_TOKEN]
    template = _chatml_template(cls.IMAGE_TOKEN)
    tokenizer = build_tiny_tokenizer(markers, chat_template=template)
    patches = {"patch_size": tiny_qwen.PATCH_SIZE, "merge_size": tiny_qwen.MERGE_SIZE}
    sizes = {"shortest_edge": tiny_qwen.MIN_PIXELS, "longest_edge": tiny_qwen.MAX_PIXELS}
    processor = cls(
        MiniMaxM3VLImageProcessor(size=sizes, **patches),
        tokenizer,
        MiniMaxM3VLVideoProcessor(min_pixels=tiny_qwen.MIN_PIXELS, max_pixels=tiny_qwen.MAX_PIXELS, **patches),
        chat_template=template,
    )
    indexer = {"index_n_heads": 2, "index_head_dim": 16, "index_block_size": 4, "index_topk_blocks": 2}
    extra = {
        "vision_config": {"patch_size": tiny_qwen.PATCH_SIZE, "spatial_merge_size": tiny_qwen.MERGE_SIZE},
        "text_config": {
            "layer_types": ["minimax_m3_sparse", "full_attention"],
            "mlp_layer_types": ["dense", "sparse"],
            "dense_intermediate_size": 128,
            "shared_intermediate_size": 32,
            **indexer,
        },
        "projector_hidden_size": 64,
        "image_token_index": tokenizer.convert_tokens_to_ids(cls.IMAGE_TOKEN),
        "video_token_index": tokenizer.convert_tokens_to_ids(cls.VIDEO_TOKEN),
    }
    _save_generic("minimax_m3_vl", target, tokenizer, processor, extra)


def build_molmo2(target: Path) -> None:
    """Molmo2: a ViT (32 x 32 crops, 4 px patches: 8 x 8) whose last two layers an attention adapter pools 2 x 2, for
    a low-resolution view of the whole image and one high-resolution crop (`max_crops: 1`): each view 4 rows of 4
    `<im_patch>` tokens and an `<im_col>`, between its start and end tokens. The processor starts each text with
    the tokenizer's BOS (its EOS here, which has none)."""
    from transformers import Molmo2ImageProcessor, Molmo2Processor, Molmo2VideoProcessor

    from hellbender.models.tiny import build_tiny_tokenizer

    layout = ["<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>", "<im_end>"]
    layout += ["<frame_end>", "<im_low>"]
    template = _chatml_template("<|image|>")
    tokenizer = build_tiny_tokenizer(layout, chat_template=template, image_token="<|image|>", video_token="<|video|>")
    crops = {"size": {"height": 32, "width": 32}, "patch_size": 4, "pooling_size": [2, 2]}
    image_processor = Molmo2ImageProcessor(max_crops=1, overlap_margins=[1, 1], **crops)
    processor = Molmo2Processor(image_processor, Molmo2VideoProcessor(**crops), tokenizer, chat_template=template)
    ids = dict(zip(layout, tokenizer.convert_tokens_to_ids(layout), strict=True))
    extra = {
        "vision_config": {"image_size": [32, 32], "patch_size": 4, "num_position_embeddings": 64, "head_dim": 16},
        "adapter_config": {"vision_feature_layer": [-1, -2], "head_dim": 16, "text_hidden_size": 64},
        "text_config": {"additional_vocab_size": 0},
        "image_start_token_id": ids["<im_start>"],
        "low_res_image_start_token_id": ids["<low_res_im_start>"],
        "image_end_token_id": ids["<im_end>"],
        "image_patch_id": ids["<im_patch>"],
        "frame_start_token_id": ids["<frame_start>"],
        "frame_end_token_id": ids["<frame_end>"],
    }
    _save_generic("molmo2", target, tokenizer, processor, extra)


def build_muse_glimmer(target: Path, model_type: str = "muse_glimmer") -> None:
    """Muse Glimmer: Qwen-VL-style patches (4 px, merged 2 x 2: a 32 x 32 image gives 16 `<|patch|>` tokens) between
    image start and end tokens, into a text model of sliding-window layers and a full-attention layer without RoPE.
    Muse Spark adds an audio tower (shrunk to four 16-wide stages) and its feature extractor, and MoE text layers."""
    from transformers import (
        MuseGlimmerImageProcessor,
        MuseGlimmerProcessor,
        MuseGlimmerVideoProcessor,
        MuseSparkFeatureExtractor,
        MuseSparkProcessor,
    )

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ["<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>", "<|vid_frame_separator|>"]
    markers += ["<|vid_start|>", "<|vid_end|>", "<|audio|>", "<|soft_audio_start|>", "<|soft_audio_end|>"]
    template = _chatml_template("<|patch|>")
    tokenizer = build_tiny_tokenizer(markers, chat_template=template)
    patches = {"patch_size": 4, "merge_size": 2}
    processors = (MuseGlimmerImageProcessor(**patches), MuseGlimmerVideoProcessor(**patches), tokenizer)
    if model_type == "muse_spark":
        processor = MuseSparkProcessor(*processors, MuseSparkFeatureExtractor(), chat_template=template)
    else:
        processor = MuseGlimmerProcessor(*processors, chat_template=template)
    extra = {
        "vision_config": {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "max_position_embeddings": 64},
        "out_hidden_size": 4 * 64,  # the merger folds 2 x 2 patches of the (shrunk) 64-wide tower into channels
        "projector_hidden_size": 64,
        "image_token_id": tokenizer.convert_tokens_to_ids("<|patch|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video|>"),
    }
    if model_type == "muse_spark":
        stages = {"hidden_sizes": [16] * 4, "depths": [1] * 4, "patch_sizes": [16, 6, 5, 4], "num_hidden_layers": 4}
        extra["audio_config"] = {**stages, "out_hidden_size": 64}
        extra["audio_token_id"] = tokenizer.convert_tokens_to_ids("<|audio|>")
        extra["text_config"] = {"moe_hidden_size": 32, "mlp_layer_types": ["dense", "sparse"]}
    _save_generic(model_type, target, tokenizer, processor, extra)


def build_nemotron_h_omni(target: Path) -> None:
    """Nemotron-H Omni: a RADIO tower (32 x 32 images, 4 px patches: 8 x 8) pixel-shuffled 2 x 2 to 16 `<image>`
    tokens between `<img>` and `</img>`, into a Nemotron-H text model (Mamba and attention layers); its audio tower
    (Parakeet) is optional and left out, the processor still carrying a feature extractor."""
    from transformers import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
        NemotronH_Omni_Reasoning_V3Processor,
        NemotronH_Omni_Reasoning_V3VideoProcessor,
        ParakeetFeatureExtractor,
    )

    from hellbender.models.tiny import build_tiny_tokenizer

    markers = ["<image>", "<video>", "<img>", "</img>", "<so_embedding>", "<so_start>", "<so_end>"]
    template = _chatml_template("<image>")
    tokenizer = build_tiny_tokenizer(markers, chat_template=template)
    patches = {"patch_size": 4, "downsample_ratio": 0.5}
    image_processor = NemotronH_Omni_Reasoning_V3ImageProcessor(min_num_patches=64, max_num_patches=64, **patches)
    video_processor = NemotronH_Omni_Reasoning_V3VideoProcessor(video_target_num_patches=64, **patches)
    processor = NemotronH_Omni_Reasoning_V3Processor(
        image_processor, video_processor, tokenizer, ParakeetFeatureExtractor(), chat_template=template
    )
    radio = {"image_size": 32, "patch_size": 4, "max_img_size": 32, "num_cls_tokens": 1, "num_registers": 1}
    extra = {
        "vision_config": radio,
        "audio_config": None,
        "vision_hidden_size": 64,
        "projector_hidden_size": 64,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<video>"),
        "audio_token_id": tokenizer.convert_tokens_to_ids("<so_embedding>"),
    }
    _save_generic("nemotron_h_omni", target, tokenizer, processor, extra)


# The builders whose processors are torchvision classes or carry a video processor: without torchvision these types
# read `not surveyed` with the reason.
TORCHVISION_BUILDERS = frozenset(
    {
        "mistral3",
        "mistral_large4",
        "llava_onevision",
        "smolvlm",
        "internvl",
        "llava_next_video",
        "glm4v",
        "glm4v_moe",
        "glm46v",
        "video_llava",
        "perception_lm",  # its vision tower comes from timm too
        "lfm3_vl",
        "hyperclovax_vision_v2",
        "dots3_note",
        "cosmos3_edge",
        "glm5_next",
        "hy_v4_vl",
        "gemma4_unified",
        "inkling2",
        "inkling2_loop",
        "inkling_mm_model",
        "apertus1p5",
        "step3p7",
        "unlimited_ocr",
        "minicpmv4_6",
        "minicpmv4_7",
        "minicpm_ocr",
        "minimax_m3_vl",
        "molmo2",
        "muse_glimmer",
        "muse_spark",
        "nemotron_h_omni",
        "mistral4",
        "glm_ocr",
        "glmga",
        "cosmos3_omni",  # its Qwen3-VL processor is loaded whole, video processor included
        "qwen2_5_omni_thinker",
        "qwen3_omni_moe_thinker",
    }
)
# Builders whose tiny model takes its vision tower from timm (which imports torchvision): surveyed beside those above.
TIMM_BUILDERS = frozenset({"gemma3n", "fast_vlm"})
# Processor classes that checkpoints of these types name in their processor configs, where transformers maps none to
# the type itself.
CHECKPOINT_PROCESSORS = {
    "cosmos3_omni": "Qwen3VLProcessor",
    "fast_vlm": "LlavaProcessor",
    "glm_ocr": "Glm46VProcessor",
    "glmga": "Glm46VProcessor",
    "kosmos-2": "Kosmos2Processor",
    "kosmos-2.5": "Kosmos2_5Processor",
    "mistral4": "PixtralProcessor",
    "qwen2_5_omni_thinker": "Qwen2_5OmniProcessor",
    "qwen3_omni_moe_thinker": "Qwen3OmniMoeProcessor",
}
# model type -> a function saving a tiny model with its processor into a directory: hellbender's own tiny VLMs, and
# families built here from their pieces
VLM_BUILDERS: dict[str, Any] = {
    "gemma4": "hellbender.models.tiny_vlm.gemma4:build",
    "idefics3": "hellbender.models.tiny_vlm.idefics3:build",
    "llava": f"{LLAVA_BUILDER}:build",
    "qwen2_5_vl": "hellbender.models.tiny_vlm.qwen2_5_vl:build",
    "qwen3_vl": "hellbender.models.tiny_vlm.qwen3_vl:build",
    "vipllava": build_vipllava,
    "gemma3": build_gemma3,
    "llava_next": build_llava_next,
    "paligemma": build_paligemma,
    "idefics2": build_idefics2,
    "lighton_ocr": build_lighton_ocr,
    "aya_vision": build_aya_vision,
    "paddleocr_vl": build_paddleocr_vl,
    "deepseek_vl": build_deepseek_vl,
    "hunyuan_vl": build_hunyuan_vl,
    "mistral3": build_mistral3,
    "mistral_large4": lambda target: build_mistral3(target, "mistral_large4"),
    "llava_onevision": build_llava_onevision,
    "smolvlm": build_smolvlm,
    "internvl": build_internvl,
    "glm4v": build_glm4v,
    "glm4v_moe": lambda target: build_glm4v(target, "glm4v_moe"),
    "glm46v": lambda target: build_glm4v(target, "glm46v"),
    "video_llava": build_video_llava,
    "llama4": build_llama4,
    "lfm2_vl": build_lfm2_vl,
    "cohere2_vision": build_cohere2_vision,
    "exaone4_5": build_exaone4_5,
    "video_llama_3": build_video_llama_3,
    "kimi_k25": build_kimi_k25,
    "cohere_compass": build_cohere_compass,
    "ernie4_5_vl_moe": build_ernie4_5_vl_moe,
    "aria": build_aria,
    "janus": build_janus,
    "chameleon": build_chameleon,
    "emu3": build_emu3,
    "ovis2": build_ovis2,
    "deepseek_vl_hybrid": build_deepseek_vl_hybrid,
    "gemma3n": build_gemma3n,
    "fuyu": build_fuyu,
    "got_ocr2": build_got_ocr2,
    "perception_lm": build_perception_lm,
    "lfm3_vl": build_lfm3_vl,
    "qianfan_ocr": build_qianfan_ocr,
    "pp_chart2table": build_pp_chart2table,
    "granite4_vision": build_granite4_vision,
    "hyperclovax_vision_v2": build_hyperclovax_vision_v2,
    "dots3_note": build_dots3_note,
    "cosmos3_edge": build_cosmos3_edge,
    "glm5_next": build_glm5_next,
    "hy_v4_vl": build_hy_v4_vl,
    "deepseek_ocr2": build_deepseek_ocr2,
    "gemma4_unified": build_gemma4_unified,
    "inkling2": build_inkling2,
    "inkling_mm_model": build_inkling,
    "apertus1p5": build_apertus1p5,
    "inkling2_loop": lambda target: build_inkling2(target, "inkling2_loop"),
    "step3p7": build_step3p7,
    "unlimited_ocr": build_unlimited_ocr,
    "minicpmv4_6": build_minicpmv,
    "minicpmv4_7": lambda target: build_minicpmv(target, "minicpmv4_7"),
    "minicpm_ocr": lambda target: build_minicpmv(target, "minicpm_ocr"),
    "minimax_m3_vl": build_minimax_m3_vl,
    "molmo2": build_molmo2,
    "muse_glimmer": build_muse_glimmer,
    "muse_spark": lambda target: build_muse_glimmer(target, "muse_spark"),
    "nemotron_h_omni": build_nemotron_h_omni,
    "mistral4": build_mistral4,
    "fast_vlm": build_fast_vlm,
    "glm_ocr": lambda target: build_glm4v(target, "glm_ocr"),
    "glmga": lambda target: build_glm4v(target, "glmga"),
    "qwen2_5_omni_thinker": lambda target: build_qwen_omni_thinker(target, "qwen2_5_omni_thinker"),
    "qwen3_omni_moe_thinker": lambda target: build_qwen_omni_thinker(target, "qwen3_omni_moe_thinker"),
    "llava_next_video": build_llava_next_video,
    "blip-2": build_blip2,
    "instructblip": lambda target: build_blip2(target, "instructblip"),
    "granite_docling": build_granite_docling,
    "shieldgemma2": lambda target: build_gemma3(target, "shieldgemma2"),
    "t5gemma2": lambda target: build_gemma3(target, "t5gemma2"),
    **{t: lambda target, t=t: build_qwen_family(t, target) for t in QWEN_PROCESSOR_FAMILIES},
}


@functools.cache
def torchvision_version() -> str | None:
    """The importable torchvision's version, or None: a torchvision that is installed but does not import beside this
    torch (a PyPI wheel built for another torch) counts as missing, since transformers then cannot use it either."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision
    except Exception:
        return None
    return torchvision.__version__


# Where an entry records the environment it was surveyed in beyond `_transformers` (a torchvision version).
TORCHVISION_KEY = "torchvision"


def surveyed_with_torchvision(entry: dict[str, Any] | None) -> str | None:
    """The torchvision version an image-text-to-text entry was surveyed with (None: surveyed without it)."""
    return (entry or {}).get(TORCHVISION_KEY)


@functools.cache
def refused_vision_families() -> dict[str, str]:
    """Model types hellbender refuses as vision-language models before loading their processor, with the reason:
    the families it names, and the mapping's encoder-decoders (by their default config)."""
    from transformers import CONFIG_MAPPING

    from hellbender.models.fixes import ENCODER_DECODER_REASON, UNSUPPORTED_VISION_FAMILIES

    refused = dict(UNSUPPORTED_VISION_FAMILIES)
    for model_type in image_text_to_text_types():
        try:
            encoder_decoder = model_type not in refused and CONFIG_MAPPING[model_type]().is_encoder_decoder
        except Exception:  # a class whose defaults fail its own validation
            encoder_decoder = False
        if encoder_decoder:
            refused[model_type] = f"{model_type}: {ENCODER_DECODER_REASON}"
    return refused


def vlm_not_surveyed_reason(model_type: str, torchvision: bool | None = None) -> str | None:
    """Why the survey cannot build `model_type` tiny with an offline processor (None where it can), on a machine with
    torchvision importable or not (`None`: this machine)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    if torchvision is None:
        torchvision = torchvision_version() is not None
    if model_type in refused_vision_families():
        return None
    if model_type in VLM_BUILDERS and (torchvision or model_type not in TORCHVISION_BUILDERS | TIMM_BUILDERS):
        return None
    processor = PROCESSOR_MAPPING_NAMES.get(model_type) or CHECKPOINT_PROCESSORS.get(model_type)
    if model_type in TIMM_BUILDERS:
        return (
            "the survey's tiny model takes its vision tower from timm, which needs torchvision, and this machine "
            "lacks torchvision (it does not import next to torch here)"
        )
    if model_type in TORCHVISION_BUILDERS:  # said outright: with torchvision installed its classes name no backend
        return (
            f"the survey builds `{processor}` with torchvision classes, and this machine lacks torchvision (it does "
            "not import next to torch here)"
        )
    if processor is None:
        return "transformers maps no processor class to this type, so no offline processor can be built for it"
    import transformers

    cls = getattr(transformers, processor, None)
    backends = getattr(cls, "_backends", ())
    if "torchvision" in backends and not torchvision:
        return f"transformers' `{processor}` requires torchvision, which this machine lacks (it does not import next to torch here)"
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    image_processors = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if isinstance(image_processors, dict) and "pil" not in image_processors and not torchvision:
        only = image_processors.get("torchvision")
        return f"its image processor `{only}` exists only as a torchvision class, and this machine lacks torchvision"
    attributes = cls.get_attributes() if hasattr(cls, "get_attributes") else ()
    if "video_processor" in attributes and not torchvision:
        return (
            f"`{processor}` always loads a video processor, which needs torchvision (missing here); hellbender's "
            "image-only processor loaders serve only Gemma 4 and the model types of the Qwen-VL processors"
        )
    return (
        f"no offline tiny `{processor}` in the survey yet (it needs the family's image tokens in the tokenizer and "
        "image processor settings sized to a tiny vision tower)"
    )


def vlm_build(model_type: str, target: Path) -> dict[str, Any]:
    """Save a tiny `model_type` vision-language model with its processor into `target`. A family hellbender refuses
    without a builder here gets its default config and hellbender's tiny tokenizer only: the refusal reads the config
    and comes before any processor or weights are loaded."""
    from transformers import AutoModelForImageTextToText

    if model_type in VLM_BUILDERS:
        builder = VLM_BUILDERS[model_type]
        if isinstance(builder, str):
            module, function = builder.split(":")
            builder = getattr(importlib.import_module(module), function)
        builder(target)
        model = AutoModelForImageTextToText.from_pretrained(target)
    else:  # a refused family: its config (what the refusal reads) and a tokenizer, no weights
        from transformers import CONFIG_MAPPING

        from hellbender.models.tiny import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        CONFIG_MAPPING[model_type]().save_pretrained(target)
        tokenizer.save_pretrained(target)
        return {"class": "config only"}
    return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters())}


# Families whose tiny processor gives more image tokens than the default rows hold (GOT-OCR2: 256 per image,
# DeepSeek-OCR-2: 145).
VLM_SEQUENCE_LEN = {"got_ocr2": 512, "deepseek_ocr2": 512}


def vlm_run_config(model_dir: Path, mode: str, output_dir: Path) -> str:
    """Image+text chat rows (the bundled coloured squares) through hellbender's multimodal path."""
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    lines = [
        f"base_model: {model_dir}",
        "processor_type: AutoProcessor",
        "datasets:",
        f"  - path: {SHAPES_DATA}",
        "    type: chat_template",
        f"dataset_prepared_path: {model_dir.parent / 'prepared'}",
        f"sequence_len: {VLM_SEQUENCE_LEN.get(model_type, 256)}",
        "micro_batch_size: 2",
        f"max_steps: {1 if mode == 'full' else 2}",
        "learning_rate: 1.0e-4",
        "gradient_checkpointing: true",
        f"output_dir: {output_dir}",
    ]
    if mode != "full":  # on a vision-language model `lora_target_linear` adapts the language model's layers
        lines += ["adapter: lora", "lora_r: 4", "lora_alpha: 8", "lora_target_linear: true"]
    return "\n".join(lines) + "\n"


def vlm_reload_status(model_dir: Path, output_dir: Path, mode: str) -> str:
    """Whether plain transformers (and PEFT, for an adapter) load the saved output again."""
    from transformers import AutoModelForImageTextToText

    try:
        if mode == "full":
            AutoModelForImageTextToText.from_pretrained(output_dir)
        else:
            from peft import PeftModel

            PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model_dir), output_dir)
    except Exception as exc:
        return describe(exc)
    return "ok"


def survey_vlm(model_type: str, timeout: float) -> dict[str, Any]:
    """One image-text-to-text type's entry: its reason where it cannot be built here, else a forked survey."""
    reason = vlm_not_surveyed_reason(model_type)
    entry = {"build": {"status": NOT_SURVEYED_PREFIX + reason}} if reason else survey(model_type, timeout, VLM_SECTION)
    if version := torchvision_version():  # the processors then differ (torchvision classes, video processors)
        import torch

        entry[TORCHVISION_KEY] = version.split("+")[0]
        entry["torch"] = torch.__version__.split("+")[0]  # that torchvision's torch, not necessarily CI's
    return entry


# ---- the document ----


def _cell(entry: dict[str, Any] | None, mode: str) -> str:
    if entry is None:
        return NOT_SURVEYED
    stage = entry.get(mode, {})
    status = stage.get("status", "-")
    if entry.get("build", {}).get("status") != "ok":
        return "-"
    eager = " (eager)" if "eager" in (stage.get("attn"), entry["build"].get("attention")) else ""
    if status == "ok" and stage.get("reload", "ok") != "ok":
        return f"ok{eager}, reload fails"
    if status == "ok" and "lora_modules" in stage:
        return f"ok ({stage['lora_modules']} modules{', experts' if stage.get('experts_adapted') else ''}){eager}"
    if status == "ok" or status.startswith(("timeout", "not run", "process died")):
        return status.split(":")[0] + eager
    return ("refused" if stage.get("refused") else "fails") + eager


def _quote(text: str) -> str:
    """One error line made safe inside a table cell's code span."""
    return text.replace("|", "/").replace("`", "'")[:160]


def _bidirectional_note(model_type: str) -> str:
    from hellbender.models.fixes.encoders import CAUSAL_SWITCHES

    if model_type in CAUSAL_SWITCHES:
        name, value = CAUSAL_SWITCHES[model_type]
        value = str(value).lower() if isinstance(value, bool) else value
        return f"attends both ways as built; hellbender sets `{name}: {value}` so it trains as a causal LM"
    return "attends both ways as built (each position sees the token it predicts)"


def _note(model_type: str, entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    build = entry.get("build", {})
    if build.get("status") != "ok":
        return f"tiny model not built: `{_quote(build.get('status', ''))}`"
    notes = []
    if timm := entry.get("timm"):
        notes.append(
            f"its vision tower is a timm model: surveyed with timm {timm} (torch {entry.get('torch', '?')}), which "
            "the project's own environment lacks"
        )
    if build.get("bidirectional"):
        notes.append(_bidirectional_note(model_type))
    if build.get("moe") and not any(entry.get(m, {}).get("experts_adapted") for m in ("lora", "packing")):
        notes.append("MoE: expert weights not LoRA-adapted")
    if build.get("attention") == "eager":
        notes.append("no SDPA path in transformers: hellbender loads it with `attn_implementation: eager`")
    if left_out := next((entry[m]["left_out"] for m in MODES if entry.get(m, {}).get("left_out")), None):
        notes.append(f"`{_quote(left_out)}`")
    if refused := next((entry[m]["checkpointing_refused"] for m in MODES if entry[m].get("checkpointing_refused")), ""):
        notes.append(f"trained without activation checkpointing, which hellbender refuses for it: `{_quote(refused)}`")
    seen = set()
    for mode in MODES:
        status = entry.get(mode, {}).get("status", "")
        if status not in ("ok", "-", "") and status not in seen:
            seen.add(status)
            notes.append(f"{mode}: `{_quote(status)}`")
        reload = entry.get(mode, {}).get("reload", "ok")
        if reload != "ok" and reload not in seen:
            seen.add(reload)
            notes.append(f"{mode} output does not reload: `{_quote(reload)}`")
    return "; ".join(notes)


def _passes(entry: dict[str, Any]) -> bool:
    return all(entry.get(m, {}).get("status") == "ok" and entry[m].get("reload", "ok") == "ok" for m in MODES)


def render(results: dict[str, Any], model_types: list[str], vlm_types: list[str] = ()) -> str:
    """docs/models.md: every type of the installed causal-LM mapping, with its survey result or `not surveyed yet`,
    then the image-text-to-text types (not surveyed by this script yet)."""
    surveyed = [t for t in model_types if t in results]
    ok = [t for t in surveyed if _passes(results[t])]
    lines = [
        "# Model architectures",
        "",
        "Generated by `scripts/model_survey.py` from `docs/models.json`; do not edit by hand "
        "(`python scripts/model_survey.py --render` rewrites it, and a test checks it is current).",
        "",
        f"Each causal-LM architecture of the installed transformers ({results.get('_transformers', '?')}) is built "
        "tiny from its config class with random weights and trained on CPU through hellbender's own training path, "
        "with activation checkpointing: LoRA on every linear layer (2 steps), the same with `sample_packing` "
        "(2 steps), and full fine-tuning (1 step); each output is then loaded again with plain transformers (and PEFT). "
        "`ok (N modules)` gives the number of LoRA-adapted modules; "
        "`experts` says expert weights were among them; `(eager)` marks an architecture without an SDPA path in "
        "transformers, which hellbender loads with `attn_implementation: eager` when the config leaves the attention to "
        "it. `refused` is hellbender's own error naming the problem "
        "(the note quotes its first line); `fails` is any other error, a bug to fix or to turn into a refusal; "
        "`-` means the tiny model could not be built (the note says why), which may be the survey's shrink "
        "rather than the architecture. A tiny random model checks that the code path runs, not training quality.",
        "",
        "Family rules hellbender applies at load time (src/hellbender/models/fixes/): encoder families that "
        "transformers lists as causal LMs (BERT and its descendants, XLM, XLNet) attend both ways as built, so "
        "hellbender sets the config switch their classes honour (`is_decoder`, `causal`, `attn_type: uni`) and they "
        "train causally; CPM-Ant has none and is refused (encoders.py). Families whose transformers classes offer no "
        "activation checkpointing (CTRL, GPT-1, GPT-NeoX Japanese, XLNet, XLM) are checkpointed by hellbender over "
        "their per-layer module lists (models/layer_list_checkpointing.py); Reformer's reversible layers recompute "
        "their activations already, so it refuses `gradient_checkpointing` and the survey trains it without "
        "(reformer.py). A causal XLNet drops the padding mask of right-padded batches, which transformers cannot "
        "add to its causal mask and which changes nothing there (xlnet.py). `sample_packing` is refused for the families "
        "whose packed rows do not score as their documents alone: layers that carry a state along the row (Mamba and "
        "its hybrids, gated delta-nets, RWKV, ...) or positions taken from the place in the row (BART and RoBERTa kin, "
        "GPT-1, XLNet, XLM; Reformer's LSH attention) (models/unpackable_families.py). tests/test_architectures.py checks each trained type "
        "further (CI a subset, `HELLBENDER_ALL_ARCHITECTURES=1` all of them): two LoRA steps lower the loss and change "
        "every adapter weight the backward reaches (a run names the modules it does not reach), the adapter reloaded "
        "with plain PEFT gives the same logits (PEFT 0.21 leaves some LoRA tensors of a few MoE families out when "
        "loading, Laguna, Inkling 2, Mistral Large 4 and two OCR models among them; hellbender's own loading places "
        "them: models/adapter_loading.py), gradients match with and without checkpointing, and packed rows score as "
        "the documents alone (tests/test_vlm_architectures.py does the same for image-text models, without packing). `lora_target_linear` leaves out, in one "
        "notice line, the layers LoRA cannot adapt: what PEFT refuses in Mamba families, Mamba-mixer projections whose "
        "weight the mixer reads directly (an adapter there would never be used), linear subclasses that are no "
        "linear map (Llama 4 and PhiMoE routers, DeepSeek-V4's grouped output projection), and the layers of a "
        "sparse-attention indexer (DeepSeek-V3.2 and V4 and the families built on them), which only picks positions "
        "by top-k and passes no gradient back; a name in `lora_target_modules` that reaches only such layers is "
        "refused, one that also reaches others adapts those (unadaptable_layers.py). An architecture without SDPA loads with `eager` "
        "unless the config asks for `sdpa`, which is refused (models/attention_choice.py). Gemma 4 assistants "
        "(draft models that run on their target model's hidden states and K/V, gemma4_assistant.py) and MusicGen's "
        "decoders (audio codes, musicgen.py) are refused by name. For Gemma 3n, hellbender fills a packed row's "
        "padding tail with another token: padding alone keeps all-zero states there, which give NaN gradients "
        "(gemma3n.py). A checkpoint whose config type the auto class does not map (Emu3's and Mllama's text models) "
        "loads through the class its `architectures` names (models/architecture_class.py).",
        "",
        f"Surveyed: {len(surveyed)} of {len(model_types)} architectures; all three modes pass for {len(ok)}. "
        f"Rows marked `{NOT_SURVEYED}` have not been run yet: their status is unknown.",
        "",
        "| architecture | LoRA | packing | full FT | note |",
        "|---|---|---|---|---|",
    ]
    for model_type in model_types:
        entry = results.get(model_type)
        cells = [_cell(entry, mode) for mode in MODES]
        lines.append(f"| {model_type} | {' | '.join(cells)} | {_note(model_type, entry)} |")
    if vlm_types:
        lines += render_vlm_section(results.get(VLM_RESULTS_KEY, {}), vlm_types, model_types)
    return "\n".join(lines) + "\n"


def vlm_status(entry: dict[str, Any] | None) -> str:
    """One image-text-to-text type's overall status: trains / refused / fails / not built / not surveyed."""
    build = (entry or {}).get("build", {}).get("status", NOT_SURVEYED)
    if entry is None or build.startswith(NOT_SURVEYED_PREFIX):
        return "not surveyed"
    if build != "ok":
        return "not built"
    stages = [entry.get(m, {}) for m in VLM_MODES]
    if any(stage.get("refused") for stage in stages):
        return "refused"
    if all(stage.get("status") == "ok" and stage.get("reload", "ok") == "ok" for stage in stages):
        return "trains"
    return "fails"


VLM_STATUSES = ("trains", "refused", "fails", "not built", "not surveyed")


def _vlm_note(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return NOT_SURVEYED
    build = entry.get("build", {}).get("status", "")
    if build.startswith(NOT_SURVEYED_PREFIX):
        return build[len(NOT_SURVEYED_PREFIX) :]
    if build != "ok":
        return f"tiny model not built: `{_quote(build)}`"
    notes, seen = [], set()
    for mode in VLM_MODES:
        for status in (entry.get(mode, {}).get("status", ""), entry.get(mode, {}).get("reload", "ok")):
            if status not in ("ok", "-", "") and status not in seen:
                seen.add(status)
                notes.append(f"{mode}: `{_quote(status)}`")
    return "; ".join(notes)


def _torchvision_paragraph(results: dict[str, Any], vlm_types: list[str]) -> list[str]:
    """Which rows were surveyed in an environment with torchvision, and with which torch and torchvision."""
    environments: dict[tuple[str, str], list[str]] = {}
    for model_type in vlm_types:
        entry = results.get(model_type)
        if version := surveyed_with_torchvision(entry):
            environments.setdefault((entry.get("torch", "?"), version), []).append(model_type)
    if not environments:
        return []
    parts = [
        f"torch {torch} and torchvision {version} ({len(types)} row{'s' * (len(types) != 1)}: {', '.join(types)})"
        for (torch, version), types in sorted(environments.items())
    ]
    return [
        "The other rows come from the project's own environment, which has no torchvision (nor has CI). Many "
        "families' processors are torchvision classes or always load a video processor, so the rows named here were "
        f"surveyed in a second environment, with {'; '.join(parts)}, CUDA builds run on the CPU (and `num2words`, "
        "which SmolVLM's processor imports, and timm, whose small `test_convnext` and `test_vit` stand in for "
        "Gemma 3n's MobileNetV5, FastVLM's FastViT-HD and PerceptionLM's Perception Encoder, and SciPy, which Inkling's vision tower imports "
        "to plan its output scales). Without torchvision these rows keep their recorded status: the survey "
        "does not redo them, and the test reads their reason as it was with torchvision. Training these families "
        "with hellbender needs torchvision too, since their processors do.",
        "",
    ]


def render_vlm_section(results: dict[str, Any], vlm_types: list[str], model_types: list[str]) -> list[str]:
    """The image-text-to-text table: one row per type of the installed mapping, with its overall status."""
    statuses = [vlm_status(results.get(t)) for t in vlm_types]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in VLM_STATUSES)
    lines = [
        "",
        "## Image-text-to-text architectures",
        "",
        "Each architecture of the installed transformers' image-text-to-text mapping, built tiny with a processor "
        "that works offline, and trained on CPU through hellbender's multimodal path (`processor_type: AutoProcessor`, "
        "the bundled coloured-squares chat rows with an image in each user turn, activation checkpointing): LoRA on "
        "the language model's linear layers (2 steps) and full fine-tuning (1 step); each output is then loaded again "
        "with plain transformers (and PEFT). The families hellbender ships as tiny VLMs (`hellbender/tiny-gemma4-vlm`, "
        "`tiny-idefics3`, `tiny-llava`, `tiny-qwen2.5-vl`, `tiny-qwen3-vl`) use those builders; the other families "
        "reuse their pieces where they share a processor or a token layout (the tiny LLaVA's, Idefics3's or "
        "Qwen-VL's tokenizer, template and image processor sizes) or get a small processor of their own on the "
        "tiny tokenizer with the family's image tokens, and their configs get the generic shrink with tiny vision "
        "settings (`VLM_BUILDERS` in the script). A type that transformers maps no processor class to is built with "
        "the class its checkpoints name (`CHECKPOINT_PROCESSORS`); the `mistral4` type itself is Mistral 4's text model "
        "(`Mistral4ForCausalLM`), so its row is Mistral Small 4's image-text layout: a `mistral3` checkpoint whose text "
        "model is a `mistral4`. Cosmos3 Edge's loaded processor is set to return "
        "`mm_token_type_ids`, which its model requires and its processor class does not return by default "
        "(models/fixes/cosmos3_edge.py). `trains`: both modes pass and reload; "
        "`refused`: hellbender stops at start with an error naming the family and the reason (quoted in the note: "
        "Mllama feeds images through cross-attention layers, ShieldGemma 2's processor replaces the text with policy "
        "prompts, Kosmos-2's and Kosmos-2.5's processors write their own image prompt in front of each text, Llama 4's "
        "image-text forward fails in transformers 5.24, DiffusionGemma is a block-diffusion model without a next-token loss, and image-text encoder-decoders such as T5Gemma 2 need decoder inputs that a chat row does not "
        "give; models/fixes/__init__.py; a refused family without a builder here is saved as its default config only); "
        "`fails`: any other error; `not built`: the survey could not build the tiny model; `not surveyed`: no "
        "offline processor is built for the family yet (the note says why), so its status is unknown.",
        "",
        f"{len(vlm_types)} architectures: {counts}.",
        "",
        *_torchvision_paragraph(results, vlm_types),
        "| architecture | status | LoRA | full FT | note |",
        "|---|---|---|---|---|",
    ]
    for model_type, status in zip(vlm_types, statuses, strict=True):
        entry = results.get(model_type)
        surveyed = status not in ("not surveyed",)
        cells = [_cell(entry, mode) if surveyed else "-" for mode in VLM_MODES]
        also = " (its causal-LM class is in the table above)" if model_type in model_types else ""
        lines.append(f"| {model_type} | {status} | {' | '.join(cells)} | {_vlm_note(entry)}{also} |")
    return lines


def failure_groups(results: dict[str, Any]) -> dict[str, list[str]]:
    """Failures grouped by cause (the error's class, where it was raised, its first line without numbers):
    cause -> the `type/stage` entries that show it."""
    groups: dict[str, list[str]] = {}
    for model_type, entry in results.items():
        if model_type.startswith("_"):
            continue
        for stage in ("build", *MODES):
            facts = entry.get(stage, {})
            for status in (facts.get("status", "-"), facts.get("reload", "ok")):
                if status in ("ok", "-") or status.startswith("not run"):
                    continue
                cause = re.sub(r"\d+", "N", status)[:140] + (f"  [{facts['where']}]" if "where" in facts else "")
                groups.setdefault(cause, []).append(f"{model_type}/{stage}")
    return dict(sorted(groups.items(), key=lambda item: -len(item[1])))


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_text_to_text_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def load_results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def write_results(results: dict[str, Any]) -> None:
    RESULTS.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")


def survey_vlm_types(args: argparse.Namespace, parser: argparse.ArgumentParser, results: dict, vlm_types: list) -> None:
    import transformers

    wanted = args.types.split(",") if args.types else vlm_types
    unknown = sorted(set(wanted) - set(vlm_types))
    if unknown:
        parser.error(f"not image-text-to-text model types of this transformers: {', '.join(unknown)}")
    section = results.setdefault(VLM_RESULTS_KEY, {})
    for model_type in wanted:
        if model_type in section and not args.redo:
            continue
        if surveyed_with_torchvision(section.get(model_type)) and not torchvision_version():
            print(f"{model_type}: kept (surveyed with torchvision, which does not import here)", flush=True)
            continue
        start = time.monotonic()
        section[model_type] = survey_vlm(model_type, args.timeout)
        results[VLM_RESULTS_KEY] = dict(sorted(section.items()))
        results["_transformers"] = transformers.__version__
        write_results(results)
        entry = section[model_type]
        summary = "  ".join(f"{m}={entry[m]['status'][:70]}" for m in ("build", *VLM_MODES) if m in entry)
        print(f"{model_type} ({time.monotonic() - start:.0f}s): {summary}", flush=True)
        section = results[VLM_RESULTS_KEY]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every unrecorded one)")
    parser.add_argument("--redo", action="store_true", help="survey the given types again even if recorded")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per type (all three modes)")
    parser.add_argument("--render", action="store_true", help="only rewrite docs/models.md from docs/models.json")
    parser.add_argument("--failures", action="store_true", help="print the recorded failures grouped by cause")
    parser.add_argument(
        "--vlm", action="store_true", help="survey image-text-to-text types (`--types` then names those)"
    )
    args = parser.parse_args()
    if str(ROOT / "src") not in sys.path:  # the notes name hellbender's own family rules
        sys.path.insert(0, str(ROOT / "src"))
    model_types = causal_lm_types()
    results = load_results()
    if args.failures:
        for cause, where in failure_groups(results).items():
            print(f"{len(where):3d}  {cause}\n     {' '.join(where)}")
        return
    if not args.render:
        _import_once()
        import transformers

        if args.vlm:
            survey_vlm_types(args, parser, results, image_text_to_text_types())
            wanted = []
        else:
            wanted = args.types.split(",") if args.types else model_types
        unknown = sorted(set(wanted) - set(model_types))
        if unknown:
            parser.error(f"not causal-LM model types of this transformers: {', '.join(unknown)}")
        for model_type in wanted:
            if model_type in results and not args.redo:
                continue
            start = time.monotonic()
            results[model_type] = survey(model_type, args.timeout)
            if model_type in CAUSAL_TIMM_TYPES and importlib.util.find_spec("timm") is not None:
                import timm
                import torch

                results[model_type].update(timm=timm.__version__, torch=torch.__version__.split("+")[0])
            results["_transformers"] = transformers.__version__
            write_results(results)  # after each type, so an interrupted survey resumes where it stopped
            summary = "  ".join(f"{m}={results[model_type][m]['status'][:70]}" for m in ("build", *MODES))
            print(f"{model_type} ({time.monotonic() - start:.0f}s): {summary}", flush=True)
    DOC.write_text(render(results, model_types, image_text_to_text_types()))


if __name__ == "__main__":
    main()
