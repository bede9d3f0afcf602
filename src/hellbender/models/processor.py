"""Loading the processor of a vision-language model (its family quirks live in `models/fixes`)."""

from __future__ import annotations

from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError


def load_processor(cfg: HellbenderConfig, source: str) -> Any:
    import transformers

    from hellbender.models.fixes import adjust_processor, processor_loader, unsupported_reason
    from hellbender.models.remote_code import remote_code_refused

    reason = unsupported_reason(source)
    if reason:
        raise ConfigError(f"`{source}` is not supported yet as a vision-language model: {reason}.")

    name = cfg.processor_type or "AutoProcessor"
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ConfigError(f"`processor_type: {name}` is not a transformers processor class (e.g. `AutoProcessor`).")
    loader = processor_loader(source) or cls.from_pretrained
    try:
        with remote_code_refused(source):
            processor = loader(source, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision_of_model)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"Could not load a processor from `{source}` with `processor_type: {name}`: {str(exc).rstrip('.')}. "
            "Check that the model is a vision-language model and that `processor_type` fits it."
        ) from None
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise ConfigError(
            f"`{source}` gave a {type(processor).__name__}, which has no image processor; `processor_type` is for "
            "vision-language models. Remove it to train a text model."
        )
    # Labels are placed from the left, so padding must go on the right.
    processor.tokenizer.padding_side = "right"
    return adjust_processor(source, processor)
