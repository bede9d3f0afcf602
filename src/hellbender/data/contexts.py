"""From a dataset entry and the config to the `FormatContext` its rows are tokenized with: masking settings,
the chat template, and for vision-language datasets the processor, image tokens and image policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hellbender.chat_templates import resolve_chat_template
from hellbender.config import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry
from hellbender.config.defaults import VISION_TYPES, default_image_base_dir, entry_with_defaults
from hellbender.data.formats import FormatContext, VisionContext
from hellbender.data.formats.base import special_token_ids
from hellbender.data.formats.chat_template import DEFAULT_ROLE_ALIASES
from hellbender.data.formats.mistral_chat import is_mistral_common
from hellbender.data.images import ImagePolicy
from hellbender.data.teacher_targets import TeacherTargets
from hellbender.data.vision_tokens import image_placeholder_id, vision_token_ids
from hellbender.errors import DataError


def image_policy(cfg: HellbenderConfig, base_dir: Path | None = None, allow_remote: bool = False) -> ImagePolicy:
    """How images are found and opened. Without `base_dir`, images are opened where they are (command-line images);
    at batch time each prepared row names the directory its images must stay inside."""
    size = cfg.image_size
    return ImagePolicy(
        base_dir=base_dir,
        allow_remote=allow_remote,
        max_pixels=cfg.max_image_pixels,
        resize_to=(size, size) if isinstance(size, int) else size,
        resample=cfg.image_resize_algorithm,
        download_dir=Path(cfg.dataset_prepared_path) / "remote_images",
    )


def image_base_dir(entry: DatasetEntry | PretrainingDatasetEntry, where: str) -> Path:
    """The directory relative image paths of `entry` start from (and may not leave), checked once for the dataset:
    otherwise every row would fail, each naming only its own image."""
    if not entry.image_base_dir:
        return default_image_base_dir(entry.path)
    base_dir = Path(entry.image_base_dir).expanduser()
    if not base_dir.is_dir():
        state = "does not exist" if not base_dir.exists() else "is not a directory"
        raise DataError(
            f"{where}: `image_base_dir: {entry.image_base_dir}` {state}. Relative image paths start from it: point it "
            "at the directory that holds the images, or remove it to start from the dataset file's directory."
        )
    return base_dir


def vision_context(entry: DatasetEntry, cfg: HellbenderConfig, processor: Any, where: str) -> VisionContext:
    policy = image_policy(cfg, base_dir=image_base_dir(entry, where), allow_remote=entry.allow_remote_images)
    return VisionContext(
        processor=processor,
        policy=policy,
        vision_ids=frozenset(vision_token_ids(processor, cfg.vision_tokens_to_mask)),
        image_ids=frozenset(vision_token_ids(processor, [])),
        placeholder_id=image_placeholder_id(processor, entry.image_token),
        image_column=entry.image_column,
        skip_bad_images=entry.skip_bad_images,
        max_tokens=cfg.sequence_len,
        cache_images=cfg.cache_images,
    )


def eot_token_ids(eot_tokens: list[str], tokenizer: Any, where: str) -> frozenset[int]:
    """The ids of `eot_tokens`, each of which must be one token of the tokenizer."""
    ids = []
    for token in eot_tokens:
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise DataError(
                f"{where}: `eot_tokens` names `{token}`, which this tokenizer splits into {len(encoded)} tokens; an "
                "end-of-turn token must be one token. Name a special token of the tokenizer (its chat template's "
                "end-of-turn marker), or add it with `special_tokens: {additional_special_tokens: [...]}`."
            )
        ids.append(encoded[0])
    return frozenset(ids)


def template_source(name: str | None, jinja: str | None, has_processor: bool) -> str:
    """Where a dataset's chat template comes from, as errors name it."""
    if name == "jinja" or (name is None and jinja):
        return "`chat_template_jinja`"
    if name is None or name == "tokenizer_default":
        owner = "processor" if has_processor else "tokenizer"
        return f"the {owner}'s own template, `chat_template: tokenizer_default`"
    return f"`chat_template: {name}`"


def format_context(
    entry: DatasetEntry, cfg: HellbenderConfig, tokenizer: Any, processor: Any = None, where: str = ""
) -> FormatContext:
    """The entry's settings as its format reads them; `where` names the dataset entry in errors. The entry's
    defaults are filled at validation (`config/defaults.py`); entries built here from others get them too."""
    entry = entry_with_defaults(entry, cfg)
    where = where or f"Dataset `{entry.path}`"
    mappings = entry.message_property_mappings or {}
    role_map = None
    if entry.roles:
        role_map = {role: role for role in DEFAULT_ROLE_ALIASES.values()}
        for target, aliases in entry.roles.items():
            role_map.update({alias: target for alias in aliases})
    template = None
    source = template_source(entry.chat_template, entry.chat_template_jinja, processor is not None)
    if entry.type == "chat_template" and processor is not None and entry.chat_template == "tokenizer_default":
        template = processor.chat_template  # a VLM's own template lives with its processor
    elif entry.type == "chat_template" and not is_mistral_common(tokenizer):  # it encodes conversations itself
        template = resolve_chat_template(entry.chat_template, entry.chat_template_jinja, tokenizer)
    return FormatContext(
        tokenizer=tokenizer,
        train_on_inputs=bool(entry.train_on_inputs),
        chat_template=template,
        field_messages=entry.field_messages,
        role_key=mappings.get("role"),
        content_key=mappings.get("content"),
        role_map=role_map,
        roles_to_train=tuple(entry.roles_to_train or ()),
        train_on_eos=entry.train_on_eos,
        eot_ids=eot_token_ids(cfg.eot_tokens, tokenizer, where) if entry.type == "chat_template" else frozenset(),
        drop_system_message=bool(entry.drop_system_message),
        thinking_field=entry.field_thinking if entry.type == "chat_template" else None,
        thinking_key=entry.template_thinking_key if entry.type == "chat_template" else None,
        template_source=source,
        tools_field=entry.field_tools if entry.type == "chat_template" else None,
        text_field=entry.text_column,
        vision=vision_context(entry, cfg, processor, where)
        if processor is not None and entry.type in VISION_TYPES
        else None,
        teacher=TeacherTargets(entry.logprobs_field, entry.temperature or 1.0, cfg.kd_temperature, len(tokenizer))
        if entry.logprobs_field
        else None,
        # mistral-common tokenizers label their conversations themselves and keep no table of added tokens
        special_ids=None if is_mistral_common(tokenizer) else special_token_ids(tokenizer),
    )
