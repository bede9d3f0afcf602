"""Encoder families that transformers lists among its causal language models (BERT and its descendants, XLM, XLNet,
CPM-Ant). Loaded as they are, their attention is bidirectional: every position sees the token it is trained to
predict, so the loss falls while the model learns nothing a causal LM can use. Training stays silent about it.

Each family here either has a config setting that its classes honour to attend causally (BERT-style classes read
`is_decoder`, as transformers documents for using BERT as a decoder; XLM reads `causal`; XLNet's `attn_type: uni`
masks later positions), which hellbender sets when it reads the config, or it is refused by name.

Why a table of model types and not a causality probe at load time: a probe needs a forward pass of the real model
before training, which cannot run where the weights are not all on one device yet (DeepSpeed ZeRO-3 partitions them
while loading, FSDP's low-memory loading leaves them on the meta device on all but one process), and costs a full
forward on a large model. `is_decoder` alone cannot tell either: it is False on GPT-NeoX and on BART's decoder, which
are causal by construction. The table is checked instead where it is cheap: tests build a tiny model of every family
listed and check, by changing a later token, that earlier logits stay the same after the switch; and
`scripts/model_survey.py` runs the same probe on every causal-LM architecture of the installed transformers, with a
test that each one found bidirectional is listed here.
"""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError

# model_type -> (config attribute, the value that makes the family's attention causal)
_IS_DECODER = ("is_decoder", True)
CAUSAL_SWITCHES: dict[str, tuple[str, Any]] = {
    **dict.fromkeys(
        (
            "bert",
            "bert-generation",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
        ),
        _IS_DECODER,
    ),
    "xlm": ("causal", True),
    "xlnet": ("attn_type", "uni"),
}

# model_type -> why it cannot train as a causal LM
REFUSED: dict[str, str] = {
    "cpmant": "CPM-Ant's forward treats the whole input as context that every position attends to, and its config has "
    "no setting that makes it causal",
}


def make_causal(config: Any, overrides: dict[str, Any]) -> None:
    """Set the family's causal switch on `config` (a no-op for every other family); refuse a family that has none,
    and an `overrides_of_model_config` that turns the switch off again."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise ConfigError(
            f"`base_model` is a `{model_type}` model, which hellbender cannot train as a causal language model: "
            f"{REFUSED[model_type]}, so each position would see the token it learns to predict. Choose a decoder "
            "model (Llama, Qwen, Gemma, GPT-2, ...)."
        )
    if model_type not in CAUSAL_SWITCHES:
        return
    name, value = CAUSAL_SWITCHES[model_type]
    if name in overrides and overrides[name] != value:
        raise ConfigError(
            f"`overrides_of_model_config.{name}: {overrides[name]}` makes this `{model_type}` model attend to later "
            f"tokens, so each position would see the token it learns to predict. hellbender trains `{model_type}` "
            f"as a causal language model with `{name}: {value}`; remove the override."
        )
    setattr(config, name, value)


def causal_notice(model_type: str | None) -> str | None:
    """The line that tells the user hellbender switched this family to causal attention, or None."""
    if model_type not in CAUSAL_SWITCHES:
        return None
    name, value = CAUSAL_SWITCHES[model_type]
    return (
        f"`{model_type}` is an encoder family that attends both ways unless its config says otherwise: hellbender "
        f"sets `{name}: {str(value).lower() if isinstance(value, bool) else value}` so it trains as a causal language "
        "model (the saved config keeps it; a LoRA adapter loaded onto the original base with plain PEFT needs the "
        "same setting)."
    )
