"""Packed batches under a real flash-attention varlen kernel (PyTorch's, on CUDA, called through transformers'
flash-attention wrapper): a micro-batch of several packed rows, joined into one row by hellbender's collators, scores
every document as it scores alone, text and image+text. tests/test_flash_packing.py is the exact CPU check."""

from __future__ import annotations

import pytest
import torch

from hellbender.data.collator import CausalLMCollator
from tests.flash_attention_double import torch_varlen, use_flash_attention
from tests.test_flash_packing import _collator_inputs, packed_rows, text_documents
from tests.test_multimodal_packing import prepared
from tests.tiny_vlms import QWEN

pytestmark = pytest.mark.gpu

# bf16 logits of documents packed against alone: rounding differs between the varlen kernel and the dense one that
# runs each document alone. The rows' documents read each other without joining: off by far more (checked below).
BF16_TOLERANCE = 0.1


def largest_difference(logits: torch.Tensor, alone: list[torch.Tensor]) -> float:
    worst, start = 0.0, 0
    for one in alone:
        worst = max(worst, (logits[start : start + len(one)] - one).abs().max().item())
        start += len(one)
    return worst


@torch.no_grad()
def test_packed_text_rows_under_pytorch_flash_varlen_score_as_their_documents_alone(monkeypatch, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).cuda().eval()
    use_flash_attention(monkeypatch, model, torch_varlen)
    docs = text_documents()
    rows = packed_rows(docs, [[0, 1], [2, 3, 4]])
    batch = CausalLMCollator(0, one_row_per_batch=True)(rows)
    logits = model(input_ids=batch["input_ids"].cuda(), position_ids=batch["position_ids"].cuda()).logits[0].float()
    alone = [model(input_ids=torch.tensor([d]).cuda()).logits[0].float() for d in docs]
    assert largest_difference(logits, alone) < BF16_TOLERANCE

    separate = CausalLMCollator(0)(rows)
    wrong = model(input_ids=separate["input_ids"].cuda(), position_ids=separate["position_ids"].cuda()).logits
    assert largest_difference(wrong[1].float(), alone[2:]) > 3 * BF16_TOLERANCE


@torch.no_grad()
def test_packed_qwen_image_rows_under_pytorch_flash_varlen_score_as_their_documents_alone(monkeypatch, tmp_path):
    from transformers import AutoModelForImageTextToText

    from hellbender.data.batching import build_collator
    from hellbender.models.packed_vision import packed_vision_inputs
    from hellbender.models.tiny import tiny_model_dir

    docs, _ = prepared(tmp_path, QWEN, packing=False)
    docs = list(docs)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir(QWEN), dtype=torch.bfloat16).cuda().eval()
    use_flash_attention(monkeypatch, model, torch_varlen)

    def run(batch: dict) -> torch.Tensor:
        inputs = {k: v.cuda() for k, v in batch.items() if k not in ("labels", "num_real_tokens")}
        inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
        inputs.update(packed_vision_inputs(model, inputs))
        return model(**inputs, use_cache=False).logits[0].float()

    collator = build_collator(*_collator_inputs(tmp_path, QWEN), one_row_per_batch=True)
    rows = [
        {"seq_lens": [d["length"] for d in docs[:2]], "documents": docs[:2]},
        {"seq_lens": [docs[2]["length"]], "documents": docs[2:]},
    ]
    logits = run(collator(rows))
    alone = [run(collator.documents([d])) for d in docs]
    assert largest_difference(logits, alone) < BF16_TOLERANCE
