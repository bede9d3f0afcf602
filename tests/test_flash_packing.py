"""Packed batches under flash attention: transformers' flash-attention wrapper finds the documents of packed rows
from their restarting position ids only in a batch of one row, so hellbender's collators join a micro-batch's
packed rows into one for such a model. Checked through transformers' real wrapper with an exact stand-in for the
kernel (tests/flash_attention_double.py): every document of a packed micro-batch of several rows scores as it does
alone, for text and for each vision-language family that packs; without joining the rows, documents read each
other."""

from __future__ import annotations

import pytest
import torch

from hellbender.data.collator import CausalLMCollator
from tests.flash_attention_double import use_flash_attention
from tests.test_multimodal_packing import forward, lora_model, prepared
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN, QWEN3

# Measured on CPU: text (float32) 2.1e-7; the vision-language families (float64 models, `lora_model`) 1.7e-16 to
# 3.3e-16.
TEXT_TOLERANCE = 1e-5
VLM_TOLERANCE = 1e-9


def text_documents() -> list[list[int]]:
    torch.manual_seed(0)
    return [torch.randint(5, 500, (n,)).tolist() for n in (7, 5, 6, 9, 4)]


def packed_rows(docs: list[list[int]], layout: list[list[int]]) -> list[dict]:
    """Packed rows as prepared: each document's first label unpredicted (see data/packing.py)."""
    rows = []
    for indices in layout:
        ids = [t for i in indices for t in docs[i]]
        labels = [t for i in indices for t in [-100, *docs[i][1:]]]
        rows.append({"input_ids": ids, "labels": labels, "seq_lens": [len(docs[i]) for i in indices]})
    return rows


def text_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def test_a_flash_attention_model_gets_its_packed_batches_as_one_row(monkeypatch, tiny_model_path):
    from hellbender.models.packed_attention import documents_need_one_row

    model = text_model(tiny_model_path)
    assert not documents_need_one_row(model)  # SDPA reads each row's documents from its own position ids
    use_flash_attention(monkeypatch, model)
    assert documents_need_one_row(model)


@torch.no_grad()
def test_packed_text_rows_under_flash_attention_score_as_their_documents_alone(monkeypatch, tiny_model_path):
    model = text_model(tiny_model_path)
    use_flash_attention(monkeypatch, model)
    docs = text_documents()
    layout = [[0, 1], [2, 3, 4]]
    rows = packed_rows(docs, layout)

    joined = CausalLMCollator(0, one_row_per_batch=True)(rows)
    assert joined["input_ids"].shape == (1, sum(map(len, docs)))  # no padding between the rows
    assert joined["num_real_tokens"].tolist() == [sum(map(len, docs))]
    logits = model(input_ids=joined["input_ids"], position_ids=joined["position_ids"], use_cache=False).logits[0]
    worst, start = 0.0, 0
    for doc in (d for indices in layout for d in indices):
        n = len(docs[doc])
        alone = model(input_ids=torch.tensor([docs[doc]]), use_cache=False).logits[0]
        worst = max(worst, (logits[start : start + n] - alone).abs().max().item())
        start += n
    assert worst < TEXT_TOLERANCE, worst

    # The labels train what the rows trained: each row's first token stays unpredicted.
    separate = CausalLMCollator(0)(rows)
    kept = separate["labels"][separate["labels"] != -100]
    assert torch.equal(joined["labels"][joined["labels"] != -100], kept)

    # The check can fail: the same rows as a batch of two reach plain causal attention over each whole row.
    wrong = model(input_ids=separate["input_ids"], position_ids=separate["position_ids"], use_cache=False).logits
    second = len(docs[0])
    alone = model(input_ids=torch.tensor([docs[1]]), use_cache=False).logits[0]
    assert (wrong[0, second : second + len(docs[1])] - alone).abs().max().item() > 1e-2


def test_joined_rows_keep_the_teacher_targets_with_their_tokens():
    """Offline distillation rows: every position's targets move with its token, and each row's first position, which
    nothing predicts within its own row, has none."""
    from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK

    rows = packed_rows([[5, 6, 7], [8, 9]], [[0], [1]])
    for row in rows:
        row[TARGET_IDS] = [[t, t + 1] for t in row["input_ids"]]
        row[TARGET_LOGPROBS] = [[-0.5, -1.0] for _ in row["input_ids"]]
    batch = CausalLMCollator(0, one_row_per_batch=True)(rows)
    assert batch[TARGET_IDS][0, :, 0].tolist() == [0, 6, 7, 0, 9]
    assert batch[TARGET_MASK][0].any(-1).tolist() == [False, True, True, False, True]
    assert batch["labels"][0].tolist() == [-100, 6, 7, -100, 9]


# Gemma 4 with image tokens attending both ways is refused under flash attention (test_multimodal_packing.py).
@pytest.mark.parametrize(
    "name", [QWEN, QWEN3, GEMMA4, LLAVA, IDEFICS3], ids=["qwen", "qwen3", "gemma4", "llava", "idefics3"]
)
@torch.no_grad()
def test_packed_image_rows_under_flash_attention_score_as_their_documents_alone(monkeypatch, tmp_path, name):
    from hellbender.data.batching import build_collator
    from hellbender.models.packed_vision import check_packable_vision_model

    alone_rows, _ = prepared(tmp_path, name, packing=False)
    model = lora_model(name)
    use_flash_attention(monkeypatch, model)
    check_packable_vision_model(model)
    collator = build_collator(*_collator_inputs(tmp_path, name), one_row_per_batch=True)
    # Two packed rows: the first two documents, then the third.
    docs = list(alone_rows)
    rows = [
        {"seq_lens": [d["length"] for d in docs[:2]], "documents": docs[:2]},
        {"seq_lens": [docs[2]["length"]], "documents": docs[2:]},
    ]
    batch = collator(rows)
    assert batch["input_ids"].shape == (1, sum(d["length"] for d in docs))
    logits = forward(model, batch)[0]
    worst, start = 0.0, 0
    for doc in docs:
        one = collator.documents([doc])
        worst = max(worst, (logits[start : start + doc["length"]] - forward(model, one)[0]).abs().max().item())
        start += doc["length"]
    assert worst < VLM_TOLERANCE, worst

    # The check can fail: the same rows as a batch of two let the first row's documents read each other.
    separate = build_collator(*_collator_inputs(tmp_path, name))(rows)
    assert separate["input_ids"].shape[0] == 2
    first, second = docs[0]["length"], docs[1]["length"]
    wrong = forward(model, separate)[0, first : first + second]
    assert (wrong - forward(model, collator.documents([docs[1]]))[0]).abs().max().item() > 1e-3


def _collator_inputs(tmp_path, name):
    from hellbender.config import validate_config
    from hellbender.models.loading import load_tokenizer_and_processor
    from tests.helpers import vlm_config

    cfg = validate_config(vlm_config(tmp_path, name, sequence_len=1024, sample_packing=True))
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    return cfg, tokenizer, processor
