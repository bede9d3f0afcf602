"""Preference datasets (`type: chatml.intel`, `chat_template.default`, ...) and the keys around them: which
combinations cannot work. Each problem is one paragraph naming the keys."""

from __future__ import annotations

from hellbender.config.data import (
    KTO_PREFERENCE_TYPES,
    USER_DEFINED_KEYS,
    VISION_PREFERENCE_TYPES,
    is_preference_type,
)
from hellbender.config.defaults import preference_keys_read
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.config.schema import HellbenderConfig

# The entry keys each preference type reads beyond `path` and the loading keys (`chat_template` keys aside).
_MESSAGE_KEYS = ("message_property_mappings", "roles", "drop_system_message")
_TEMPLATE_KEYS = ("chat_template", "chat_template_jinja")
READS: dict[str, tuple[str, ...]] = {
    "chat_template.default": ("field_messages", "field_chosen", "field_rejected", *_MESSAGE_KEYS, *_TEMPLATE_KEYS),
    "chat_template.argilla_chat": ("field_chosen", "field_rejected", *_MESSAGE_KEYS, *_TEMPLATE_KEYS),
    "chat_template.argilla": ("field_chosen", "field_rejected", *_MESSAGE_KEYS, *_TEMPLATE_KEYS),
    "bradley_terry.chat_template": ("field_chosen", "field_rejected", *_TEMPLATE_KEYS),
}
# Entry keys that only preference types read: set on another type, they would do nothing.
PREFERENCE_ONLY_KEYS = tuple(USER_DEFINED_KEYS)
# SFT keys that mean nothing for preference rows (the prompt is never trained; answers are whole).
SFT_ONLY_KEYS = ("roles_to_train", "train_on_eos", "train_on_inputs", "field_thinking", "template_thinking_key",
                 "field_tools", "field", "text_column")  # fmt: skip
_MESSAGE_LIST_TYPES = {"chatml.argilla_chat", "llama3.argilla_chat", "chatml.ultra", "llama3.ultra"}


def _type_of(entry) -> str:
    return entry.type or "pretokenized"


# The methods that train on pairs whose prompts hold images (DPO's loss family, on TRL's DPOTrainer).
VISION_PREFERENCE_METHODS = ("dpo", "ipo")


def _vision_preference_problems(cfg: HellbenderConfig, preference: list) -> list[str]:
    """With `processor_type` (a vision-language model), pairs whose prompts hold images train with `rl: dpo` or
    `rl: ipo` on the chat-template types that read message lists (docs/preference.md, "Vision-language models")."""
    problems = []
    if cfg.rl not in VISION_PREFERENCE_METHODS:
        method = f"`rl: {cfg.rl}`" if cfg.rl else "`reward_model: true`"
        problems.append(
            f"{method} with `processor_type` (a vision-language model) is not supported yet: pairs whose prompts hold "
            "images train with `rl: dpo` or `rl: ipo`. Use one of those, or remove `processor_type` to train the "
            "language model on text pairs."
        )
    for where, e in preference:
        if e.type not in VISION_PREFERENCE_TYPES:
            problems.append(
                f"`{where}` (`{e.path}`): `type: {e.type}` reads text rows, and with `processor_type` (a "
                "vision-language model) the preference rows are conversations that may hold images: use "
                + " or ".join(f"`type: {t}`" for t in VISION_PREFERENCE_TYPES)
                + ", or remove `processor_type` to train the language model on text pairs."
            )
    if cfg.precompute_ref_log_probs:
        problems.append(
            "`precompute_ref_log_probs: true` is not supported yet with `processor_type` (a vision-language model): "
            "the reference model scores each pair's images as the batch is built. Remove `precompute_ref_log_probs` "
            "(with an adapter the reference is the base model with the adapter off, with no second copy in memory)."
        )
    if cfg.dpo_shared_prompt:
        problems.append(
            "`dpo_shared_prompt: true` is not supported with `processor_type` (a vision-language model): a pair's "
            "images belong to its prompt, which is scored once per answer. Remove `dpo_shared_prompt`."
        )
    return problems


def preference_data_problems(cfg: HellbenderConfig) -> list[str]:
    if cfg.rl in ONLINE_RL_METHODS:  # prompt rows, not pairs (`rl_checks.py`)
        return []
    entries = [(f"datasets[{i}]", e) for i, e in enumerate(cfg.datasets)]
    entries += [(f"test_datasets[{i}]", e) for i, e in enumerate(cfg.test_datasets)]
    preference = [(where, e) for where, e in entries if is_preference_type(e.type)]
    problems = [
        f"`{where}` (`{e.path}`) sets {', '.join(f'`{k}`' for k in keys)}, which only preference types "
        f"(`user_defined.default`) read; `type: {_type_of(e)}` would ignore {'it' if len(keys) == 1 else 'them'}. "
        "Remove them, or set the preference `type` the data has."
        for where, e in entries
        if not is_preference_type(e.type) and (keys := [k for k in PREFERENCE_ONLY_KEYS if k in e.model_fields_set])
    ]
    trains_preferences = cfg.rl is not None or cfg.reward_model
    if trains_preferences and not preference and (cfg.datasets or cfg.pretraining_dataset):
        method = f"`rl: {cfg.rl}`" if cfg.rl else "`reward_model: true`"
        problems.append(
            f"{method} trains on preference data, and no entry of `datasets` has a preference `type` "
            "(`chat_template.default`, `chatml.intel`, ...; docs/preference.md lists them with a row of each). Set the "
            f"`type` your rows have, or remove {method.split(':')[0]}` to train with supervised fine-tuning."
        )
    if preference and not trains_preferences:
        where, entry = preference[0]
        problems.append(
            f"`{where}` (`{entry.path}`) has the preference type `{entry.type}`, and neither `rl` nor `reward_model` is "
            "set, so nothing would train on its pairs. Set `rl: dpo` (or another method, docs/preference.md) or "
            "`reward_model: true`; for supervised fine-tuning on chat rows use `type: chat_template`."
        )
    if not preference:
        if cfg.max_prompt_len is not None:
            problems.append(
                "`max_prompt_len` limits the prompts of preference data, and no dataset has a preference `type` "
                "(`chat_template.default`, `chatml.intel`, ...): it would do nothing. Remove it."
            )
        return problems
    sft = [(where, e) for where, e in entries if not is_preference_type(e.type)]
    if sft or cfg.pretraining_dataset:
        named = ", ".join(f"`{where}` (`type: {_type_of(e)}`)" for where, e in sft[:3])
        named = named or "`pretraining_dataset`"
        problems.append(
            f"The datasets mix preference data (`{preference[0][0]}`, `type: {preference[0][1].type}`) with "
            f"supervised data ({named}); one run trains on one kind. Give every entry of `datasets` and "
            "`test_datasets` a preference `type`, or train on the supervised data in a separate run."
        )
    # `sample_packing` and `streaming` are refused with `rl` / `reward_model` (preference_checks.py), which
    # preference data needs.
    if cfg.eval_sample_packing:
        problems.append(
            "`eval_sample_packing: true` is not supported with preference data yet: a pair's chosen and rejected "
            "sequences share their prompt and are batched together, not packed. Remove `eval_sample_packing`."
        )
    if cfg.group_by_length:
        problems.append(
            "`group_by_length: true` is not supported with preference data yet (it groups supervised rows by their "
            "length). Remove `group_by_length`."
        )
    if cfg.train_on_inputs:
        problems.append(
            "`train_on_inputs: true` asks to train the prompt, which preference tuning never does (only the answers "
            "are compared). Remove `train_on_inputs`."
        )
    if cfg.is_multimodal:
        problems += _vision_preference_problems(cfg, preference)
    kto = getattr(cfg, "rl", None) == "kto"
    for where, e in preference:
        if kto and e.type not in KTO_PREFERENCE_TYPES:
            problems.append(
                f"`{where}` (`{e.path}`): `type: {e.type}` gives pairs of chosen and rejected answers, and `rl: kto` "
                "trains on single answers labelled desirable or not. Use one of KTO's types: "
                + ", ".join(f"`{t}`" for t in KTO_PREFERENCE_TYPES)
                + "."
            )
        reads = preference_keys_read(e.type, kto) if e.type == "user_defined.default" else READS.get(e.type, ())
        unread = [k for k in (*_MESSAGE_KEYS, *_TEMPLATE_KEYS, "field_messages", "field_chosen", "field_rejected",
                              *USER_DEFINED_KEYS, *SFT_ONLY_KEYS)
                  if k in e.model_fields_set and k not in reads and getattr(e, k) not in (None, False)]  # fmt: skip
        if e.type in _MESSAGE_LIST_TYPES:  # their message lists are read with these keys
            unread = [k for k in unread if k not in _MESSAGE_KEYS]
        if unread:
            problems.append(
                f"`{where}` (`{e.path}`): `type: {e.type}` does not read {', '.join(f'`{k}`' for k in unread)}, so "
                f"{'it' if len(unread) == 1 else 'they'} would do nothing. Remove "
                f"{'it' if len(unread) == 1 else 'them'} (docs/preference.md lists the fields each type reads)."
            )
    return problems
