"""What every built-in tiny VLM must do, one test per behaviour, parametrised over the families (the `tiny_vlm*`
fixtures in conftest.py; per-family facts in tests/tiny_vlms.py): it builds deterministically, a row with an image
trains the vision side and the language model, two images fill their placeholders in order, a batch may mix rows
with and without images, and a text-only row never reaches the vision side. What is particular to one family (its
chat template, how its processor expands an image, its ids) is in tests/test_tiny_vlm_<family>.py."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from hellbender.models.tiny import TINY_MODELS
from tests.tiny_vlms import training_labels


def image_chat(*images, answer: str = "A cat.") -> list[dict]:
    parts = []
    for i, image in enumerate(images):
        parts += [{"type": "image", "image": image}, {"type": "text", "text": f"Image {i}."}]
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def tokenize_chat(processor, messages):
    """Template and images through the processor's own chat template, as tensors."""
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


def test_build_is_deterministic(tiny_vlm, tiny_vlm_dir, tmp_path):
    module, function = TINY_MODELS[tiny_vlm.name].split(":")
    getattr(importlib.import_module(module), function)(tmp_path)
    files = sorted(p.name for p in tiny_vlm_dir.iterdir())
    assert files == sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and "processor_config.json" in files
    for name in files:
        # A cached build (HELLBENDER_CACHE) made by older builder code also differs: bump TINY_VERSION.
        assert (tmp_path / name).read_bytes() == (tiny_vlm_dir / name).read_bytes(), name


def test_forward_with_labels_and_backward(tiny_vlm, tiny_vlm_processor, tiny_vlm_model):
    processor, model = tiny_vlm_processor, tiny_vlm_model
    enc = tokenize_chat(processor, image_chat(tiny_vlm.image(0)))
    assert (enc["input_ids"] == processor.image_token_id).sum().item() == tiny_vlm.tokens_per_image
    labels = training_labels(enc, processor, tiny_vlm)
    model.zero_grad()
    out = model(**enc, labels=labels)
    assert math.isfinite(out.loss.item())
    assert out.logits.shape == (*enc["input_ids"].shape, len(processor.tokenizer))
    shifted = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, 1:], ignore_index=-100)
    torch.testing.assert_close(out.loss, shifted)
    out.loss.backward()
    for name in tiny_vlm.trained_by_an_image_row:
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    for name in tiny_vlm.untrained_by_an_image_row:
        assert model.get_parameter(name).grad is None, name
    model.zero_grad()

    # The image reaches the language model: another image changes the logits after it, up to the last one.
    other = tokenize_chat(processor, image_chat(tiny_vlm.image(1)))
    with torch.no_grad():
        logits = model(**other).logits
    assert not torch.allclose(logits, out.logits.detach(), atol=1e-4)
    assert (logits[0, -1] - out.logits.detach()[0, -1]).abs().max() > 1e-4


def test_two_images_in_one_row(tiny_vlm, tiny_vlm_processor, tiny_vlm_model):
    processor, model = tiny_vlm_processor, tiny_vlm_model
    first, second = tiny_vlm.image(0), tiny_vlm.image(1)
    enc = tokenize_chat(processor, image_chat(first, second))
    assert (enc["input_ids"] == processor.image_token_id).sum().item() == 2 * tiny_vlm.tokens_per_image
    model.zero_grad()
    out = model(**enc, labels=training_labels(enc, processor, tiny_vlm))
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    for name in tiny_vlm.trained_by_an_image_row:
        assert model.get_parameter(name).grad.abs().sum() > 0, name
    model.zero_grad()
    # The images fill their placeholders in order: swapping them changes the logits.
    swapped = tokenize_chat(processor, image_chat(second, first))
    assert torch.equal(swapped["input_ids"], enc["input_ids"])
    with torch.no_grad():
        assert not torch.allclose(model(**swapped).logits, out.logits.detach(), atol=1e-4)


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_batch_with_a_row_without_image(tiny_vlm, tiny_vlm_processor, tiny_vlm_model, layout):
    """Images go per row as nested lists (`[]` for a row without one), or flat in the order of the placeholders
    over the batch where the processor allows it. Each row gives the same logits as alone: the image went to the row
    holding its placeholders, and padding (on the right) changes nothing."""
    processor, model = tiny_vlm_processor, tiny_vlm_model
    image = tiny_vlm.image(0)
    text_only = processor.apply_chat_template(
        [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "Hi."}], tokenize=False
    )
    with_image = processor.apply_chat_template(image_chat(image), tokenize=False)
    rows = [text_only, with_image]
    images = [[], [image]] if layout == "nested" else [image]
    if layout == "flat" and not tiny_vlm.flat_images:
        with pytest.raises(ValueError, match="number of"):
            processor(text=rows, images=images, padding=True, return_tensors="pt")
        return
    assert processor.tokenizer.padding_side == "right"  # the row-alone comparison below relies on it
    enc = processor(text=rows, images=images, padding=True, return_tensors="pt")
    assert (enc["input_ids"] == processor.image_token_id).sum(dim=1).tolist() == [0, tiny_vlm.tokens_per_image]
    with torch.no_grad():
        out = model(**enc, labels=training_labels(enc, processor, tiny_vlm))
        assert math.isfinite(out.loss.item())
        for row, (text, row_images) in enumerate([(text_only, None), (with_image, [image])]):
            alone = processor(text=[text], images=row_images, return_tensors="pt")
            length = alone["input_ids"].shape[1]
            assert enc["input_ids"][row, :length].tolist() == alone["input_ids"][0].tolist()
            torch.testing.assert_close(out.logits[row, :length], model(**alone).logits[0], atol=1e-5, rtol=1e-5)


def test_text_only_forward(tiny_vlm, tiny_vlm_processor, tiny_vlm_model):
    processor, model = tiny_vlm_processor, tiny_vlm_model
    text = processor.apply_chat_template(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi."}], tokenize=False
    )
    enc = processor(text=[text, "bye"], padding=True, return_tensors="pt")
    assert set(enc.keys()) == tiny_vlm.text_only_keys  # no pixel values, grids or image positions
    model.zero_grad()
    out = model(**enc, labels=training_labels(enc, processor, tiny_vlm))
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    first_layer = model.get_decoder().layers[0]
    for name, param in [
        ("first layer q_proj", first_layer.self_attn.q_proj.weight),
        ("first layer up_proj", first_layer.mlp.up_proj.weight),
        ("output embeddings", model.get_output_embeddings().weight),
    ]:
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    for module in tiny_vlm.vision_modules:
        reached = [n for n, p in model.get_submodule(module).named_parameters() if p.grad is not None]
        assert not reached, (module, reached)
    model.zero_grad()
