"""`tokenizer_use_mistral_common`: the library must be installed, and keys that edit the tokenizer or choose a Jinja
template cannot apply, since mistral-common encodes conversations itself from one fixed tokenizer file."""

from __future__ import annotations

from importlib import metadata, util

from hellbender.config.schema import HellbenderConfig

# The oldest mistral-common that transformers' `MistralCommonBackend` accepts, and that hellbender was checked with.
MISTRAL_COMMON_FLOOR = (1, 11, 5)
INSTALL_HINT = "`pip install 'hellbender[mistral]'`"


def _installed_version() -> tuple[int, ...] | None:
    """The installed mistral-common's version, (0,) when its version cannot be read, None when it is not installed."""
    if util.find_spec("mistral_common") is None:
        return None
    try:
        text = metadata.version("mistral-common")
    except metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def mistral_common_problems(cfg: HellbenderConfig) -> list[str]:
    if not cfg.tokenizer_use_mistral_common:
        return []
    key = "`tokenizer_use_mistral_common: true`"
    floor = ".".join(map(str, MISTRAL_COMMON_FLOOR))
    problems = []
    version = _installed_version()
    if version is None or version < MISTRAL_COMMON_FLOOR:
        found = "is not installed" if version is None else f"is older than {floor}"
        problems.append(
            f"{key} loads the tokenizer with Mistral's mistral-common library, which {found}. Install it with "
            f"{INSTALL_HINT} (mistral-common>={floor}), or remove the key to load the model's `tokenizer.json` "
            "with its Jinja chat template."
        )
    edits = [k for k in ("special_tokens", "tokens") if getattr(cfg, k)]
    if edits:
        problems.append(
            f"{key} cannot be combined with {' or '.join(f'`{k}`' for k in edits)}: a mistral-common tokenizer is "
            "fixed by its tokenizer file and cannot add or rename tokens (its pad, BOS and EOS tokens are already "
            "set). Remove those keys, or remove `tokenizer_use_mistral_common` to edit a `tokenizer.json` tokenizer."
        )
    if cfg.tokenizer_type != "AutoTokenizer":
        problems.append(
            f"{key} loads transformers' `MistralCommonBackend`, so `tokenizer_type: {cfg.tokenizer_type}` would be "
            "ignored. Remove one of the two keys."
        )
    templates = [("", cfg.chat_template, cfg.chat_template_jinja)] + [
        (f"Dataset `{e.path}`: ", e.chat_template, e.chat_template_jinja) for e in cfg.datasets + cfg.test_datasets
    ]
    for where, name, jinja in templates:
        if name not in (None, "tokenizer_default") or jinja:
            chosen = f"`chat_template: {name}`" if name not in (None, "tokenizer_default") else "`chat_template_jinja`"
            problems.append(
                f"{where}{chosen} cannot apply with {key}: mistral-common encodes conversations with the model's own "
                "format, never a Jinja template. Remove it (or set `chat_template: tokenizer_default`), or remove "
                "`tokenizer_use_mistral_common` to train with a chat template."
            )
    if cfg.eot_tokens:
        problems.append(
            f"`eot_tokens` cannot apply with {key}: mistral-common ends every assistant turn with the EOS token "
            "`</s>`, and `train_on_eos` decides whether it is trained. Remove `eot_tokens`."
        )
    for list_key, entries in (("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets)):
        for i, entry in enumerate(entries):
            others = [r for r in entry.roles_to_train or [] if r != "assistant"]
            if others:
                problems.append(
                    f"`{list_key}[{i}].roles_to_train` names {', '.join(f'`{r}`' for r in others)}: with {key} only "
                    "assistant turns can be trained (mistral-common wraps the other roles' text in control tokens "
                    "it encodes as a whole). Use `roles_to_train: [assistant]`, or `train_on_inputs: true` to train "
                    "every token."
                )
    if cfg.is_multimodal:
        problems += _vision_problems(cfg, key)
    return problems


def _vision_problems(cfg: HellbenderConfig, key: str) -> list[str]:
    """With `processor_type`, mistral-common encodes the images too (its image encoder, which needs OpenCV); what
    relies on a transformers processor expanding an image token in rendered text cannot apply."""
    problems = []
    if cfg.processor_type != "AutoProcessor":
        audio = (
            " (audio models such as Voxtral are not supported yet)" if "voxtral" in cfg.processor_type.lower() else ""
        )
        problems.append(
            f"`processor_type: {cfg.processor_type}` would be ignored with {key}: mistral-common's own image encoder "
            f"processes the images{audio}. Use `processor_type: AutoProcessor` to train a Mistral vision model on "
            "image+text conversations."
        )
    if _installed_version() is not None and util.find_spec("cv2") is None:
        problems.append(
            f"{key} with `processor_type` encodes images with mistral-common, which resizes them with OpenCV, and "
            f"OpenCV is not installed. Install it with {INSTALL_HINT} (mistral-common[image])."
        )
    entries = cfg.datasets + cfg.test_datasets + cfg.pretraining_dataset
    raw = sorted(
        {e.path for e in entries if e.type == "multimodal_pretrain"} | {e.path for e in cfg.pretraining_dataset}
    )
    if raw:
        problems.append(
            f"Dataset {', '.join(f'`{p}`' for p in raw)}: raw image+text (`multimodal_pretrain`, "
            f"`pretraining_dataset`) cannot be encoded with {key}, which encodes conversations only. Give the data "
            "as `type: chat_template` conversations, or remove `tokenizer_use_mistral_common`."
        )
    tokens = sorted({e.path for e in entries if e.image_token})
    if tokens:
        problems.append(
            f"Dataset {', '.join(f'`{p}`' for p in tokens)}: `image_token` cannot apply with {key}: mistral-common "
            "places its own `[IMG]` tokens for each image part. Remove `image_token`."
        )
    return problems
