"""From a dataset entry and the config to the `FormatContext` its rows are tokenized with: masking settings,
the chat template, and for vision-language datasets the processor, image tokens and image policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hellbender.chat_templates import resolve_chat_template
from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.data.formats import FormatContext, VisionContext
from hellbender.data.formats.chat_template import DEFAULT_ROLE_ALIASES
from hellbender.data.images import ImagePolicy
from hellbender.data.vision_tokens import image_placeholder_id, vision_token_ids
from hellbender.errors import DataError

# Dataset types whose rows hold images.
VISION_TYPES = ("chat_template", "multimodal_pretrain")


def default_image_base_dir(entry: DatasetEntry) -> Path:
    """Image paths start from the dataset file's directory (the directory itself for a directory source)."""
    path = Path(entry.path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return Path.cwd()


def image_policy(cfg: HellbenderConfig, base_dir: Path = Path("."), allow_remote: bool = False) -> ImagePolicy:
    """How images are found and opened; at batch time only the decoding settings matter (paths are resolved)."""
    size = cfg.image_size
    return ImagePolicy(
        base_dir=base_dir,
        allow_remote=allow_remote,
        max_pixels=cfg.max_image_pixels,
        resize_to=(size, size) if isinstance(size, int) else size,
        resample=cfg.image_resize_algorithm,
        download_dir=Path(cfg.dataset_prepared_path) / "remote_images",
    )


def vision_context(entry: DatasetEntry, cfg: HellbenderConfig, processor: Any, where: str = "") -> VisionContext:
    if entry.image_base_dir:
        base_dir = Path(entry.image_base_dir).expanduser()
        if not base_dir.is_dir():  # else every row would fail, each naming only its own image
            state = "does not exist" if not base_dir.exists() else "is not a directory"
            raise DataError(
                f"{where or f'Dataset `{entry.path}`'}: `image_base_dir: {entry.image_base_dir}` {state}. Relative "
                "image paths start from it: point it at the directory that holds the images, or remove it to start "
                "from the dataset file's directory."
            )
    policy = image_policy(
        cfg,
        base_dir=Path(entry.image_base_dir).expanduser() if entry.image_base_dir else default_image_base_dir(entry),
        allow_remote=entry.allow_remote_images,
    )
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


def format_context(
    entry: DatasetEntry, cfg: HellbenderConfig, tokenizer: Any, processor: Any = None, where: str = ""
) -> FormatContext:
    """`where` names the dataset entry in errors about its settings."""
    train_on_inputs = cfg.train_on_inputs if entry.train_on_inputs is None else entry.train_on_inputs
    mappings = entry.message_property_mappings or {}
    role_map = None
    if entry.roles:
        role_map = {role: role for role in DEFAULT_ROLE_ALIASES.values()}
        for target, aliases in entry.roles.items():
            role_map.update({alias: target for alias in aliases})
    template = None
    name = entry.chat_template or cfg.chat_template
    if entry.type == "chat_template" and processor is not None and name == "tokenizer_default":
        template = processor.chat_template  # a VLM's own template lives with its processor
    elif entry.type == "chat_template":
        template = resolve_chat_template(name, entry.chat_template_jinja or cfg.chat_template_jinja, tokenizer)
    return FormatContext(
        tokenizer=tokenizer,
        train_on_inputs=train_on_inputs,
        chat_template=template,
        field_messages=entry.field_messages,
        role_key=mappings.get("role", "role"),
        content_key=mappings.get("content", "content"),
        role_map=role_map,
        roles_to_train=tuple(entry.roles_to_train or ("assistant",)),
        train_on_eos=entry.train_on_eos or "turn",
        text_field=entry.field or entry.text_column or "text",
        vision=vision_context(entry, cfg, processor, where)
        if processor is not None and entry.type in VISION_TYPES
        else None,
    )
