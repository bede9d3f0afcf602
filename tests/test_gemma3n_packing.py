"""Gemma 3n under sample packing: a packed row's padding tail of zero embeddings gives NaN gradients (the root of
a zero magnitude at the end of its text model), so hellbender fills that tail with another token for this family,
which leaves the documents' loss unchanged (models/fixes/gemma3n.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hellbender.data.collator import CausalLMCollator
from hellbender.models.fixes.gemma3n import packed_tail_token_id
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import model_survey

survey = model_survey()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(survey.tiny_config("gemma3n_text", tokenizer)).train()


def _rows() -> list[dict]:
    first, second = list(range(10, 22)), list(range(30, 39))
    row = {"input_ids": first + second, "labels": first + second, "seq_lens": [len(first), len(second)]}
    return [row, {"input_ids": first, "labels": first, "seq_lens": [len(first)]}]  # the second row has a tail


def _step(model, batch) -> tuple[float, bool]:
    model.zero_grad()
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}
    loss = model(**batch, use_cache=False).loss  # as the trainer runs it: the packed masks need no cache
    loss.backward()
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return loss.item(), finite


def test_a_padding_tail_gives_nan_gradients_and_the_tail_token_fixes_them_with_the_same_loss(model, tokenizer):
    tail = packed_tail_token_id(model, tokenizer)
    assert tail is not None and tail != tokenizer.pad_token_id
    padded = CausalLMCollator(tokenizer.pad_token_id)(_rows())
    filled = CausalLMCollator(tokenizer.pad_token_id, packed_tail_token_id=tail)(_rows())
    assert (filled["input_ids"][1, 12:] == tail).all() and (filled["labels"][1, 12:] == -100).all()
    assert torch.equal(padded["position_ids"], filled["position_ids"])
    padded_loss, padded_finite = _step(model, padded)
    filled_loss, filled_finite = _step(model, filled)
    assert not padded_finite  # the quirk this fix exists for; if it passes, transformers guarded the root
    assert filled_finite
    assert filled_loss == pytest.approx(padded_loss, abs=1e-6)  # the tail is a block of its own with no labels


def test_other_families_keep_a_padding_tail(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=len(tokenizer)
        )
    )
    assert packed_tail_token_id(llama, tokenizer) is None
    batch = CausalLMCollator(tokenizer.pad_token_id, packed_tail_token_id=None)(_rows())
    assert (batch["input_ids"][1, 12:] == tokenizer.pad_token_id).all()
