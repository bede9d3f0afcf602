"""Which model types share a processor class, as the installed transformers maps them (Qwen3-VL's processor also
serves Qwen3-VL MoE and Qwen3.5): a family's processor fix then applies to every type that uses the class."""

from __future__ import annotations


def types_using(processor_class: str) -> tuple[str, ...]:
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    def names(value: object) -> tuple:
        return value if isinstance(value, tuple) else (value,)

    return tuple(sorted(t for t, value in PROCESSOR_MAPPING_NAMES.items() if processor_class in names(value)))
