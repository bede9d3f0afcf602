"""Image-text-to-text architectures, each built tiny by the model survey's builder (scripts/model_survey.py, with the
processor class its checkpoints name) and loaded through hellbender's own path, on two collated image chat rows of the
bundled coloured-squares data (hellbender's preparation and collator):

- two LoRA steps on the language model lower the loss and change every adapter weight the backward reaches (the
  modules it does not reach are the ones a run names: train/unused_weights.py);
- the adapter reloaded on the base with plain transformers + PEFT gives the trained logits (once hellbender places
  what PEFT 0.21 leaves out for a few MoE families: models/adapter_loading.py);
- gradients are the same with activation checkpointing and without.

Packed image+text rows are checked per family in tests/test_multimodal_packing.py. CI runs `REPRESENTATIVE` (the
families whose tiny builders need no torchvision); `HELLBENDER_ALL_ARCHITECTURES=1` runs every type the survey's
table lists as training that this interpreter can build (torchvision and timm where the builder needs them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForImageTextToText

from hellbender.config import validate_config
from hellbender.data.batching import build_collator
from hellbender.data.collator import REAL_TOKENS_KEY, forward_kwargs
from hellbender.data.prepare import prepare_datasets
from hellbender.models.adapter_loading import complete_adapter_load
from hellbender.models.loading import load_tokenizer_and_processor
from hellbender.models.stack import build_trainable_model
from hellbender.train.trainer import causal_lm_loss
from tests.helpers import assert_two_lora_steps_learn, model_survey, vlm_config

survey = model_survey()
REPRESENTATIVE = ("gemma4", "idefics3", "llava", "qwen2_5_vl", "qwen3_vl")
# Adapters PEFT 0.21 loads only in part (models/adapter_loading.py): linear layers whose names share a part with a
# module adapted through `target_parameters` (shared experts, a dense layer's `down_proj` beside the experts').
PEFT_LOADS_IN_PART = {"deepseek_ocr2", "inkling2", "inkling2_loop", "mistral_large4", "unlimited_ocr"}
# Builders that import a package beyond torchvision and timm (the survey's rows name it).
NEEDS = {"inkling_mm_model": "scipy"}


def surveyed_as_training() -> list[str]:
    results = survey.load_results().get(survey.VLM_RESULTS_KEY, {})
    return sorted(
        t
        for t in survey.image_text_to_text_types()
        if all(results.get(t, {}).get(m, {}).get("status") == "ok" for m in survey.VLM_MODES)
        and survey.vlm_not_surveyed_reason(t) is None
    )


TYPES = surveyed_as_training() if os.environ.get("HELLBENDER_ALL_ARCHITECTURES") == "1" else REPRESENTATIVE


@pytest.fixture(scope="module")
def tiny_dirs() -> dict[str, Path]:
    return {}


def tiny_dir(model_type: str, cache: dict[str, Path], tmp_path_factory) -> Path:
    if model_type not in cache:
        if model_type in NEEDS:
            pytest.importorskip(NEEDS[model_type])
        target = tmp_path_factory.mktemp(model_type)
        survey.vlm_build(model_type, target)
        cache[model_type] = target
    return cache[model_type]


def prepared(model_dir: Path, model_type: str, tmp_path: Path, **settings):
    """The trainable model and a collated batch of two image rows, as a training run of these settings gets them."""
    cfg = validate_config(
        vlm_config(
            tmp_path,
            str(model_dir),
            adapter="lora",
            lora_r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            lora_target_linear=True,
            sequence_len=survey.VLM_SEQUENCE_LEN.get(model_type, 256),
            **settings,
        )
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    rows = prepare_datasets(cfg, tokenizer, processor).train
    batch = build_collator(cfg, tokenizer, processor)([rows[i] for i in range(2)])
    batch.pop(REAL_TOKENS_KEY, None)
    batch.update(forward_kwargs(batch))
    return build_trainable_model(cfg, tokenizer), batch


def loss_of(model, batch: dict, seed: int = 1) -> torch.Tensor:
    """hellbender's loss (the Trainer's `compute_loss_func`) of one forward, with the same dropout masks each time."""
    torch.manual_seed(seed)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    dtype = next(model.parameters()).dtype
    inputs = {k: v.to(dtype) if torch.is_tensor(v) and torch.is_floating_point(v) else v for k, v in inputs.items()}
    return causal_lm_loss(model(**inputs), batch["labels"])


def logits_of(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize("model_type", TYPES)
def test_lora_trains_on_images_and_reloads_with_plain_peft(model_type, tiny_dirs, tmp_path_factory, tmp_path):
    model_dir = tiny_dir(model_type, tiny_dirs, tmp_path_factory)
    model, batch = prepared(model_dir, model_type, tmp_path, gradient_checkpointing=True)
    assert_two_lora_steps_learn(model, lambda m: loss_of(m, batch))

    model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=next(model.parameters()).dtype)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # plain PEFT drops some saved tensors of these families; hellbender's loading places them (models/adapter_loading.py)
    assert (complete_adapter_load(reloaded, tmp_path / "adapter") > 0) == (model_type in PEFT_LOADS_IN_PART)
    torch.testing.assert_close(logits_of(reloaded, batch), logits_of(model, batch), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_gradients_on_images_are_the_same_with_and_without_checkpointing(
    model_type, tiny_dirs, tmp_path_factory, tmp_path
):
    model_dir = tiny_dir(model_type, tiny_dirs, tmp_path_factory)
    gradients = []
    for checkpointing in (False, True):
        model, batch = prepared(
            model_dir, model_type, tmp_path / str(checkpointing), gradient_checkpointing=checkpointing
        )
        loss_of(model.train(), batch).backward()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None})
    plain, checkpointed = gradients
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)
