"""Older Axolotl spellings of keys hellbender knows by today's name: each is read as today's key, with one notice
line naming the modern spelling, so configs written for earlier Axolotl releases run unchanged."""

from __future__ import annotations

from typing import Any

from hellbender.config.yaml_file import yaml_word

# older top-level key -> today's key
TOP_LEVEL: dict[str, str] = {
    "dataset_processes": "dataset_num_proc",
    "evaluation_strategy": "eval_strategy",  # transformers' own older name
    "model_config": "overrides_of_model_config",
    "bfloat16": "bf16",  # no mixed precision: hellbender's `bf16` trains the bfloat16 weights as loaded
    "float16": "fp16",
    "pretrain_multipack_buffer_size": "streaming_multipack_buffer_size",
    "dpo_beta": "rl_beta",
    "sequence_parallel_degree": "context_parallel_size",
}
# Axolotl's fused-module patches -> the Liger kernel that fuses the same computation (speed only, never the result)
FUSED_PATCHES: dict[str, tuple[str, str]] = {
    "flash_attn_fuse_mlp": ("liger_glu_activation", "fused SwiGLU MLP"),
    "flash_attn_rms_norm": ("liger_rms_norm", "fused RMSNorm"),
}
# Keys where 0 means what leaving the key out means (Axolotl reads them as unset when false-y).
ZERO_MEANS_UNSET = ("evals_per_epoch", "saves_per_epoch", "cosine_constant_lr_ratio")
# older dataset-entry key -> the key of `message_property_mappings` it sets
ENTRY_MESSAGE_FIELDS: dict[str, str] = {
    "message_field_role": "role",
    "message_field_content": "content",
}
ENTRY_LISTS = ("datasets", "test_datasets")


def read_older_spellings(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rewrite older spellings in `raw` to today's keys. Returns (problems, notices): a key given in both spellings
    with different values is a problem; each rewrite is a notice."""
    problems: list[str] = []
    notices: list[str] = []
    for old, new in TOP_LEVEL.items():
        if raw.get(old) is False and new in ("bf16", "fp16"):
            del raw[old]  # `bfloat16: false` asks for nothing (`evaluation_strategy: no`, read as false, does)
        elif raw.get(old) is True and raw.get(new) is False and new in ("bf16", "fp16"):
            # Axolotl's pair for half-precision weights without its mixed-precision wrapper (`float16: true`,
            # `fp16: false`): hellbender's `fp16` / `bf16` load the weights in that precision too.
            del raw[old], raw[new]
            raw[new] = True
            notices.append(
                f"`{old}: true` beside `{new}: false` is Axolotl's older way to train {old} weights without mixed "
                f"precision; read as `{new}: true`, which loads the weights in {old} too"
                + (" (and scales the loss, so small gradients do not underflow)." if new == "fp16" else ".")
            )
        elif old in raw:
            _move(raw, old, new, "", problems, notices)
    for key in ZERO_MEANS_UNSET:
        if raw.get(key) == 0 and raw[key] is not False:
            del raw[key]
            notices.append(f"`{key}: 0` is read as unset (as in Axolotl): the default schedule applies.")
    _fused_patches(raw, problems, notices)
    _gemma4_hybrid_attention(raw, problems, notices)
    _warmup_fraction(raw, problems, notices)
    _activation_offloading(raw, problems, notices)
    _base_model_config(raw, problems, notices)
    for list_key in ENTRY_LISTS:
        entries = raw.get(list_key)
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, dict):
                continue
            where = f"In `{list_key}[{i}]`: "
            if entry.get("type") == "sharegpt":
                _sharegpt(entry, where, problems, notices)
            for old, part in ENTRY_MESSAGE_FIELDS.items():
                if old not in entry:
                    continue
                value = entry.pop(old)
                mappings = entry.setdefault("message_property_mappings", {})
                if not isinstance(mappings, dict):
                    continue  # the mapping's own type error is reported by validation
                if part in mappings and mappings[part] != value:
                    problems.append(
                        f"{where}`{old}: {value}` and `message_property_mappings.{part}: {mappings[part]}` say "
                        f"different things; keep `message_property_mappings` (today's spelling)."
                    )
                    continue
                mappings[part] = value
                notices.append(
                    f"{where}`{old}` is an older spelling; read as `message_property_mappings.{part}: {value}`."
                )
    return problems, notices


# ShareGPT rows: `conversations` of `{from, value}` messages, the speakers called human and gpt
SHAREGPT_ENTRY = {
    "type": "chat_template",
    "field_messages": "conversations",
    "message_property_mappings": {"role": "from", "content": "value"},
    "roles": {"user": ["human"], "assistant": ["gpt"], "system": ["system"]},
}


def _sharegpt(entry: dict[str, Any], where: str, problems: list[str], notices: list[str]) -> None:
    """Axolotl's removed `type: sharegpt` (with `conversation:` naming the template) is today's `chat_template` type
    reading ShareGPT's keys; keys the entry already sets are kept."""
    from hellbender.chat_templates import NAMED_TEMPLATES

    conversation = entry.pop("conversation", None)
    if conversation is not None:
        if conversation not in NAMED_TEMPLATES:
            problems.append(
                f"{where}`conversation: {conversation}` (of `type: sharegpt`) is not a chat template hellbender "
                "knows; set the entry's `chat_template` to one of those `hellbender schema` lists, or leave it out "
                "to use the model's own template."
            )
        elif entry.get("chat_template") not in (None, conversation):
            problems.append(f"{where}`conversation` and `chat_template` name different templates; keep one.")
        else:
            entry["chat_template"] = conversation
    for key, value in SHAREGPT_ENTRY.items():
        entry[key] = value if key == "type" else entry.get(key) or value
    notices.append(
        f"{where}`type: sharegpt` is an older spelling; read as `type: chat_template` with ShareGPT's keys "
        "(`field_messages: conversations`, `from` / `value`, speakers `human` / `gpt`)"
        + (f" and `chat_template: {conversation}`." if entry.get("chat_template") == conversation else ".")
    )


def _base_model_config(raw: dict[str, Any], problems: list[str], notices: list[str]) -> None:
    """Older Axolotl configs name the model's config.json source in `base_model_config`, almost always the base
    model itself; that is what hellbender reads."""
    value = raw.pop("base_model_config", None)
    if value is None or value == raw.get("base_model"):
        if value is not None:
            notices.append("`base_model_config` names `base_model` itself, which is where the config is read from.")
        return
    problems.append(
        f"`base_model_config: {value}` reads the model's config from elsewhere than `base_model`; hellbender reads "
        "it from `base_model`. Change single settings with `overrides_of_model_config`, or remove the key."
    )


def _warmup_fraction(raw: dict[str, Any], problems: list[str], notices: list[str]) -> None:
    """transformers 5 reads a `warmup_steps` below 1 as a fraction of all steps (it dropped `warmup_ratio`), and
    Axolotl configs written for it say `warmup_steps: 0.1`; that is hellbender's `warmup_ratio`."""
    value = raw.get("warmup_steps")
    if not isinstance(value, float) or not 0 < value < 1:
        return  # whole numbers are steps; other values get the schema's own error
    if raw.get("warmup_ratio") is not None:
        problems.append(
            f"`warmup_steps: {yaml_word(value)}` is a fraction of all steps (transformers 5 reads a value below 1 so), "
            f"and `warmup_ratio: {yaml_word(raw['warmup_ratio'])}` sets the warm-up too; keep one."
        )
        del raw["warmup_steps"]
        return
    raw["warmup_ratio"] = raw.pop("warmup_steps")
    notices.append(
        f"`warmup_steps: {yaml_word(value)}` is below 1, which transformers 5 reads as a fraction of all steps; read "
        f"as `warmup_ratio: {yaml_word(value)}`."
    )


# Axolotl's offloading modes that keep checkpointed activations in host memory, and how hellbender's one way of doing
# that (the layers' saved inputs in pinned memory, copied on a side stream) relates to each.
_HOST_OFFLOADING = {
    True: "",
    "legacy": " (Axolotl's older offloading, which copies synchronously; hellbender copies the same activations on a "
    "side stream)",
    "hidden_states": " (the checkpointed layers' inputs kept in host memory, which is what it does)",
}


def _activation_offloading(raw: dict[str, Any], problems: list[str], notices: list[str]) -> None:
    """Axolotl's `activation_offloading: true` (or `legacy` / `hidden_states`) is hellbender's
    `gradient_checkpointing: offload`."""
    value = raw.get("activation_offloading")
    if value is None or value is False:
        raw.pop("activation_offloading", None)
        return
    if not isinstance(value, (bool, str)) or value not in _HOST_OFFLOADING:
        problems.append(
            f"`activation_offloading: {yaml_word(value)}` is not offered: hellbender offloads checkpointed activations "
            "to host memory only (`activation_offloading: true`, `legacy` or `hidden_states`, or "
            "`gradient_checkpointing: offload`)."
        )
        raw.pop("activation_offloading")
        return
    if raw.get("gradient_checkpointing") not in (None, True, "offload"):
        problems.append(
            f"`activation_offloading: {yaml_word(value)}` offloads the activations of checkpointed layers, and "
            f"`gradient_checkpointing` is {raw['gradient_checkpointing']!r}: set it to true (or remove one of them)."
        )
        raw.pop("activation_offloading")
        return
    raw.pop("activation_offloading")
    raw["gradient_checkpointing"] = "offload"
    notices.append(
        f"`activation_offloading: {yaml_word(value)}` is read as `gradient_checkpointing: offload`{_HOST_OFFLOADING[value]}."
    )


def _fused_patches(raw: dict[str, Any], problems: list[str], notices: list[str]) -> None:
    for patch, (liger_key, what) in FUSED_PATCHES.items():
        value = raw.pop(patch, None)
        if not value:
            continue
        if raw.get(liger_key) is False:
            problems.append(
                f"`{patch}: true` asks for Liger's {what} (`{liger_key}`), which is set to false; keep one."
            )
            continue
        raw[liger_key] = True
        notices.append(
            f"`{patch}: true` (Axolotl's {what} patch) is read as `{liger_key}: true`: Liger's {what} computes the "
            "same, faster."
        )


def _gemma4_hybrid_attention(raw: dict[str, Any], problems: list[str], notices: list[str]) -> None:
    """Axolotl's `gemma4_hybrid_attn_impl` runs Gemma 4's sliding layers under flash attention and its 512-wide
    full-attention layers (wider than flash attention takes) under SDPA. hellbender runs every Gemma 4 layer under
    PyTorch's SDPA, whose flash and memory-efficient kernels take both widths without the math kernel
    (`models/attention.py`): the same attention, by another kernel on the sliding layers."""
    if not raw.pop("gemma4_hybrid_attn_impl", None):
        return
    attn = raw.get("attn_implementation")
    if attn not in (None, "flash_attention_2", "sdpa"):
        problems.append(
            f"`gemma4_hybrid_attn_impl: true` picks Gemma 4's attention kernels, and `attn_implementation: {attn}` "
            "picks another; keep one (hellbender reads the former as `attn_implementation: sdpa`)."
        )
        return
    raw["attn_implementation"] = "sdpa"
    raw.pop("flash_attention", None)
    notices.append(
        "`gemma4_hybrid_attn_impl: true` (Axolotl: flash attention on Gemma 4's sliding layers, SDPA on its 512-wide "
        "full-attention layers) is read as `attn_implementation: sdpa`: hellbender runs every Gemma 4 layer under "
        "PyTorch's SDPA, whose flash and memory-efficient kernels take both widths (never the math kernel)."
    )


def _move(raw: dict[str, Any], old: str, new: str, where: str, problems: list[str], notices: list[str]) -> None:
    value = raw.pop(old)
    if raw.get(new) is not None and raw[new] != value:
        problems.append(
            f"{where}`{old}: {yaml_word(value)}` and `{new}: {yaml_word(raw[new])}` are the same key in two spellings with "
            f"different values; keep `{new}` (today's spelling)."
        )
        return
    raw[new] = value
    notices.append(f"{where}`{old}` is an older spelling of `{new}`; read as `{new}: {yaml_word(value)}`.")
