"""Families whose packed rows do not score as their documents alone, whatever mask hellbender builds: `sample_packing`
is refused for them by name, with the reason.

Found by tests/test_architectures.py (`HELLBENDER_ALL_ARCHITECTURES=1` runs every causal-LM type of the installed
transformers; CI runs a subset that includes both kinds): a packed row of four random documents against each document
alone, per-token losses in float32, on transformers 5.24 without optional kernel packages. In every family below the
first document matches and a later one is off by 1e-3 to 2 in loss, so a later document reads the ones before it.

- State: the family has recurrent, linear-attention, state-space or convolution layers (or compresses the sequence
  into blocks) that carry a state along the row. transformers' code for them does not restart that state at a
  document boundary: its PyTorch paths ignore boundaries, and hellbender does not pass boundaries to the varlen
  kernels that take them.
- Positions: the forward derives positions from a token's place in the row (learned or sinusoidal absolute positions,
  RoBERTa's positions counted from the padding, XLNet's and XLM's own), not from the position ids that restart with
  each packed document, so a later document's tokens get other positions than alone.
- Reformer: its LSH and local attention sort and chunk the tokens of the whole row, not of each document, and its
  axial position embeddings are the row's (measured on its one training length, 128: losses 1.07 off).
"""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError

STATE = (
    "its layers carry a state along the row (recurrent, linear-attention, state-space or convolution layers, or a "
    "compression of the sequence into blocks) that transformers does not restart where a packed document starts, so "
    "each document would read the ones packed before it"
)
REFORMER = (
    "its LSH and local attention group the tokens of the whole row into buckets and chunks, whatever the documents, "
    "and its axial position embeddings follow the place in the row"
)
POSITIONS = (
    "its forward takes positions from a token's place in the row, not from the position ids that restart with each "
    "packed document, so a later document's tokens would get other positions than alone"
)

UNPACKABLE: dict[str, str] = {
    **dict.fromkeys(
        (
            "bailing_hybrid",
            "bamba",
            "blt",
            "deepseek_v4",
            "dory",
            "falcon_h1",
            "falcon_mamba",
            "granitemoehybrid",
            "inkling2_loop_text",
            "inkling2_text",
            "jamba",
            "kimi_linear",
            "lara_mini",
            "lfm3",
            "mamba",
            "mamba2",
            "minimax",
            "nemotron_h",
            "olmo_hybrid",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "qwen3_5_text",
            "qwen3_next",
            "qwen4_exp",
            "qwen4_exp_text",
            "recurrent_gemma",
            "rwkv",
            "xlstm",
            "zamba",
            "zamba2",
            "zaya",
        ),
        STATE,
    ),
    **dict.fromkeys(
        (
            "bart",
            "big_bird",
            "bigbird_pegasus",
            "blenderbot",
            "blenderbot-small",
            "camembert",
            "data2vec-text",
            "marian",
            "mbart",
            "megatron-bert",
            "mvp",
            "openai-gpt",
            "pegasus",
            "plbart",
            "prophetnet",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roformer",
            "trocr",
            "xlm",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xlnet",
        ),
        POSITIONS,
    ),
    "reformer": REFORMER,
}


def refuse_unpackable(config: Any) -> None:
    """Refuse packing for a text config whose family is listed above."""
    model_type = getattr(config, "model_type", None)
    if model_type not in UNPACKABLE:
        return
    raise ConfigError(
        f"`sample_packing` cannot keep the packed documents of this `{model_type}` model apart: {UNPACKABLE[model_type]}."
        " Set `sample_packing: false` (rows are then padded, and every row is scored alone)."
    )
