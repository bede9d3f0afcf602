"""The model class for a config the auto class does not map.

Some families' causal-LM class takes the text part of a composite config (Emu3, Mllama): a checkpoint that class
saves has a text config type (`emu3_text_model`, `mllama_text_model`) that `AutoModelForCausalLM` does not list, so
loading it again through the auto class fails although `config.json` names the class that wrote it in
`architectures`. That named class is used then, when it is a transformers class built from exactly this config type
(anything else keeps the auto class and its own error).
"""

from __future__ import annotations

from typing import Any


def class_for_config(cls: Any, config: Any) -> Any:
    """`cls`, or, where `cls` is an auto class that does not map `config`'s type, the transformers class that
    `config.architectures` names and whose `config_class` is that type."""
    import transformers

    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None or type(config) in mapping:
        return cls
    for name in getattr(config, "architectures", None) or ():
        named = getattr(transformers, name, None)
        if named is not None and getattr(named, "config_class", None) is type(config):
            return named
    return cls
