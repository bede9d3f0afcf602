"""Attention masks for packed batches of the model families whose forward builds its masks without position ids.

A packed batch reaches the model as restarting position ids and no attention mask (`data/collator.py`):
transformers' mask builder finds the documents there and builds each layer pattern's mask (full, sliding window,
chunked) — but only where the model's forward hands it the position ids. The families below do not (measured
with transformers 5.24: a tiny gpt-oss under eager attention scored the second document of a packed row 0.06 off
the document alone), so their packed documents would attend to each other under SDPA, eager or flex attention.
For them the trainer and `hellbender evaluate` build the masks with those same transformers builders, given the
position ids, and pass them as `attention_mask`: one mask where the model has one layer pattern, else a mapping by
layer type, which these forwards take as masks already prepared. Flash attention needs nothing here: its kernel
reads the documents from the position ids, which every family passes to its attention layers.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from hellbender.errors import ConfigError
from hellbender.models.unpackable_families import refuse_unpackable

# Causal-LM model types whose forward calls transformers' mask builders without `position_ids` (transformers 5.24;
# tests/test_packed_attention.py reads the installed transformers' model code to keep this list complete). A type
# listed here that does pass them is harmless: the masks built here are the ones transformers would build.
MASKS_WITHOUT_POSITION_IDS = frozenset(
    {
        "afmoe",
        "bart",
        "bert",
        "bert-generation",
        "bigbird_pegasus",
        "biogpt",
        "blenderbot",
        "blenderbot-small",
        "bloom",
        "camembert",
        "electra",
        "ernie",
        "falcon",  # transformers 5.17
        "gpt_oss",
        "granitemoehybrid",
        "marian",
        "mbart",
        "mpt",
        "musicgen",
        "musicgen_melody",
        "mvp",
        "opt",
        "pegasus",
        "plbart",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "trocr",
        "xglm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xmod",
    }
)


# Families listed above whose forward also derives something else from `attention_mask` and needs it 2-D, so a packed
# batch's block-diagonal mask cannot be passed: model_type -> what the forward derives from it.
NEEDS_A_PADDING_MASK = {"bloom": "BLOOM builds its ALiBi position biases from the 2-D padding mask"}


def _builders() -> dict[str, Any]:
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )

    return {
        "full_attention": create_causal_mask,
        "sliding_attention": create_sliding_window_causal_mask,
        "chunked_attention": create_chunked_causal_mask,
    }


def _no_cache(builder: Any) -> dict[str, None]:
    """The builder's "no KV cache" argument: `cache` in transformers 5.24, `past_key_values` in 5.17."""
    return {"cache": None} if "cache" in inspect.signature(builder).parameters else {"past_key_values": None}


def unwrapped(model: Any) -> Any:
    """The transformers (or PEFT) model inside a distributed wrapper: DDP's has no `config`, DeepSpeed's engine has
    its own (a dict)."""
    while not hasattr(getattr(model, "config", None), "get_text_config") and hasattr(model, "module"):
        model = model.module
    return model


def text_config(model: Any) -> Any:
    return unwrapped(model).config.get_text_config()


def needs_packed_masks(config: Any) -> bool:
    """Whether packed batches of this model need `packed_attention_mask`: a family that builds its masks without
    position ids, under an attention backend that takes masks (not flash attention)."""
    return config.model_type in MASKS_WITHOUT_POSITION_IDS and not is_flash(config)


def is_flash(config: Any) -> bool:
    """Whether the model's attention reads packed documents from the position ids itself (takes no mask)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    implementation = config._attn_implementation
    return (
        implementation not in ALL_MASK_ATTENTION_FUNCTIONS
        or ALL_MASK_ATTENTION_FUNCTIONS[implementation] is flash_attention_mask
    )


def documents_need_one_row(model: Any) -> bool:
    """Whether packed batches must reach this model as one row: transformers' flash-attention wrapper (also used by
    flash-like hub kernels) derives the documents' boundaries from restarting position ids only when the batch has
    one row. With more rows it runs plain causal attention over each whole row, and a row's documents read each
    other (measured on the tiny Llama: logits 0.5 off the documents alone)."""
    return is_flash(text_config(model))


def layer_patterns(config: Any) -> list[str]:
    """The layer types whose masks the model reads, in a stable order; refuses a type hellbender cannot build."""
    types = list(dict.fromkeys(getattr(config, "layer_types", None) or ["full_attention"]))
    unknown = [t for t in types if t not in _builders()]
    if unknown:
        raise ConfigError(
            f"`sample_packing` with `attn_implementation: {config._attn_implementation}` cannot keep the packed "
            f"documents of this `{config.model_type}` model apart: its forward builds masks without position ids, "
            f"and it has layers of type {', '.join(unknown)}, whose masks hellbender does not build. Use flash "
            "attention (`attn_implementation: flash_attention_2`), or set `sample_packing: false`."
        )
    return types


def chunks_restart_at_each_document(config: Any) -> bool:
    """Whether the installed transformers' chunked-attention mask counts chunks from each packed document's start,
    as the document alone would (transformers 5.24 does; 5.17 counts them from the packed row's start, so a
    document's chunks shift by where it sits in the row). Probed on a 6-token row of two documents, chunks of 2."""
    from transformers.masking_utils import create_chunked_causal_mask

    probe = copy.copy(config)
    probe.attention_chunk_size = 2
    mask = create_chunked_causal_mask(
        config=probe,
        inputs_embeds=torch.empty((1, 6, 0)),
        attention_mask=None,
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
        **_no_cache(create_chunked_causal_mask),
    )
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return bool(allowed[0, 0, 4, 3])  # the second document's 2nd token sees its 1st: one chunk from its start


def check_packed_masks(model: Any) -> None:
    """At loading, with packing on: fail now, not at the first batch, where the masks cannot be built."""
    import transformers

    config = text_config(model)
    refuse_unpackable(config)  # no mask keeps these families' documents apart
    if needs_packed_masks(config) and config.model_type in NEEDS_A_PADDING_MASK:
        raise ConfigError(
            f"`sample_packing` cannot keep the packed documents of this `{config.model_type}` model apart: its forward "
            "builds its masks without position ids, so hellbender would pass a block-diagonal mask per packed row, and "
            f"{NEEDS_A_PADDING_MASK[config.model_type]}, which must stay 2-D. Set `sample_packing: false`."
        )
    if needs_packed_masks(config):
        layer_patterns(config)
    chunked = "chunked_attention" in (getattr(config, "layer_types", None) or [])
    if chunked and not is_flash(config) and not chunks_restart_at_each_document(config):
        raise ConfigError(
            f"`sample_packing` with this `{config.model_type}` model's chunked attention is not supported with "
            f"transformers {transformers.__version__}: its chunked mask counts chunks from the start of the packed "
            "row, not of each document, so a packed document would be cut into other chunks than alone. Set "
            "`sample_packing: false`, or use a transformers release that counts them per document (5.24 does)."
        )


def packed_attention_mask(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """`{"attention_mask": ...}` for a packed batch (position ids, no mask) of a model that needs it; else `{}`."""
    if "position_ids" not in batch or "attention_mask" in batch:
        return {}
    config = text_config(model)
    if not needs_packed_masks(config):
        return {}
    position_ids = batch["position_ids"]
    embeddings = unwrapped(model).get_input_embeddings()
    # The builders read only the batch size, length, dtype (eager's additive masks) and device of the embeddings.
    shape_of_embeds = torch.empty((*position_ids.shape, 0), dtype=embeddings.weight.dtype, device=position_ids.device)
    builders = _builders()
    masks = {
        pattern: builders[pattern](
            config=config,
            inputs_embeds=shape_of_embeds,
            attention_mask=None,
            position_ids=position_ids,
            **_no_cache(builders[pattern]),
        )
        for pattern in layer_patterns(config)
    }
    return {"attention_mask": masks["full_attention"] if list(masks) == ["full_attention"] else masks}
