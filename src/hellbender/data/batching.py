"""The collator a config trains and evaluates with: padded (or packed) token rows for text models, the processor's
batches for vision-language models. Training and `hellbender evaluate` both build it here, so they batch alike."""

from __future__ import annotations

import math
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.data.collator import CausalLMCollator
from hellbender.data.contexts import image_policy
from hellbender.data.formats.mistral_chat import is_mistral_common
from hellbender.data.mistral_image_collator import MistralImageCollator
from hellbender.data.multimodal_collator import MultimodalCollator
from hellbender.data.multimodal_packed_collator import PackedMultimodalCollator
from hellbender.data.vision_tokens import vision_token_ids


def build_collator(
    cfg: HellbenderConfig,
    tokenizer: Any,
    processor: Any | None,
    packed_tail_token_id: int | None = None,
    one_row_per_batch: bool = False,
) -> CausalLMCollator | MultimodalCollator | PackedMultimodalCollator | MistralImageCollator:
    """`packed_tail_token_id`: what fills a packed text row after its last document, where the model needs other
    than padding there (the training recipe asks the model's family fixes). `one_row_per_batch`: join a batch's
    packed rows into one, for a model whose attention finds packed documents only in a batch of one row
    (`models/packed_attention.documents_need_one_row`)."""
    if processor is None:
        pad_to = cfg.sequence_len if cfg.pad_to_sequence_len else None
        if cfg.splits_sequences:  # PyTorch's context parallelism cuts each row into 2 x N equal chunks
            pad_to = math.lcm(pad_to or 1, 2 * cfg.context_parallel_size)
        return CausalLMCollator(
            tokenizer.pad_token_id,
            pad_to_multiple_of=pad_to,
            packed_tail_token_id=packed_tail_token_id,
            one_row_per_batch=one_row_per_batch,
        )
    if is_mistral_common(processor.tokenizer):  # rows hold every token; only the pixels are made here
        return MistralImageCollator(processor, image_policy(cfg))
    documents = MultimodalCollator(
        processor, image_policy(cfg), frozenset(vision_token_ids(processor, cfg.vision_tokens_to_mask))
    )
    if cfg.sample_packing or cfg.eval_sample_packing:
        return PackedMultimodalCollator(documents, processor.tokenizer.pad_token_id, one_row_per_batch)
    return documents
