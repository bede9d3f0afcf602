"""The tiny LLaVA-1.5 built in code: it saves, loads through the Auto classes (no torchvision), renders its
chat template, expands `<image>` into exactly the number of tokens the model consumes, and trains."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hellbender.models.tiny_vlm import llava

IMAGE_ID = 512  # the first id after the tiny tokenizer's 512 base tokens + its specials <|endoftext|>, <|pad|>, ...
N = llava.IMAGE_SEQ_LENGTH  # 16 = (32 // 8) ** 2 patches; CLIP's CLS is counted (+1) and dropped ("default")


def _image(seed: int, size=(40, 50)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    target = tmp_path_factory.mktemp("tiny-llava")
    llava.build(target)
    return target


@pytest.fixture(scope="module")
def processor(llava_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def model(llava_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(llava_dir).eval()


def _ids(processor, text: str) -> list[int]:
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _labels(enc, image_id: int = IMAGE_ID) -> torch.Tensor:
    labels = enc["input_ids"].clone()
    labels[(labels == image_id) | (enc["attention_mask"] == 0)] = -100
    return labels


def test_processor_and_model_load_back_consistently(llava_dir, processor, model):
    from transformers import AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor

    assert type(processor) is LlavaProcessor
    # Without torchvision the PIL image processor loads; with it, the torchvision one (both read the same file).
    assert type(processor.image_processor).__name__.startswith("CLIPImageProcessor")
    assert type(model) is LlavaForConditionalGeneration
    assert processor.image_token == "<image>"
    assert processor.image_token_id == IMAGE_ID == model.config.image_token_id
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == IMAGE_ID
    assert _ids(processor, "<image>") == [IMAGE_ID]  # one special token, never split by the BPE
    assert (processor.patch_size, processor.num_additional_image_tokens) == (8, 1)
    assert processor.vision_feature_select_strategy == model.config.vision_feature_select_strategy == "default"
    assert model.config.image_seq_length == N == 16
    assert processor.tokenizer.eos_token == "<|endoftext|>"
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    assert processor.chat_template == tokenizer.chat_template == llava.LLAVA_CHAT_TEMPLATE
    assert tokenizer.image_token == "<image>"


def test_build_is_deterministic(llava_dir, tmp_path):
    llava.build(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (llava_dir / "model.safetensors").read_bytes()


def test_chat_template_renders_llava_turns(processor):
    parts = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]},
    ]
    assert processor.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == (
        "Be brief. USER: <image>\nWhat is this? ASSISTANT: A cat.<|endoftext|>USER: And this?<image> ASSISTANT:"
    )
    # String contents (what hellbender's data pipeline passes) are inserted verbatim, spaces included.
    strings = [{"role": "user", "content": "<image>\n hi "}, {"role": "assistant", "content": " ok"}]
    expected = "USER: <image>\n hi  ASSISTANT:  ok<|endoftext|>"
    assert processor.apply_chat_template(strings, tokenize=False) == expected
    assert processor.tokenizer.apply_chat_template(strings, tokenize=False) == expected
    with pytest.raises(Exception, match="unknown role tool"):
        processor.tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_processor_expands_each_image_token(processor):
    enc = processor(text="USER: <image>\nhi", images=_image(0), return_tensors="pt")
    expected = _ids(processor, "USER: ") + [IMAGE_ID] * N + _ids(processor, "\nhi")
    assert enc["input_ids"][0].tolist() == expected
    assert tuple(enc["pixel_values"].shape) == (1, 3, 32, 32)  # any input size is resized + cropped to 32 x 32


def test_forward_with_labels_and_backward(processor, model):
    messages = [
        {"role": "user", "content": [{"type": "image", "image": _image(0)}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    enc = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert (enc["input_ids"] == IMAGE_ID).sum().item() == N
    labels = _labels(enc)
    model.zero_grad()
    out = model(**enc, labels=labels)
    assert math.isfinite(out.loss.item())
    shifted = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, 1:], ignore_index=-100)
    torch.testing.assert_close(out.loss, shifted)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name in (
        "model.multi_modal_projector.linear_1.weight",
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    # LLaVA-1.5 reads the vision tower's second-to-last layer (`vision_feature_layer=-2`), so its last layer
    # and post_layernorm never get a gradient: "every trainable parameter changes" checks must exclude them.
    assert grads["model.vision_tower.encoder.layers.1.mlp.fc1.weight"] is None
    assert grads["model.vision_tower.post_layernorm.weight"] is None
    model.zero_grad()

    # The image really reaches the language model: another image changes the answer's logits.
    messages[0]["content"][0]["image"] = _image(1)
    other = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        assert not torch.allclose(model(**other).logits, out.logits.detach(), atol=1e-4)


def test_two_images_in_one_row_fill_their_placeholders_in_order(processor, model):
    text = "USER: <image>\n<image>\nSame? ASSISTANT: No."
    enc = processor(text=text, images=[_image(0), _image(1)], return_tensors="pt")
    assert (enc["input_ids"] == IMAGE_ID).sum().item() == 2 * N
    assert tuple(enc["pixel_values"].shape) == (2, 3, 32, 32)
    swapped = processor(text=text, images=[_image(1), _image(0)], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, labels=_labels(enc))
        assert math.isfinite(out.loss.item())
        first_block_end = enc["input_ids"][0].tolist().index(IMAGE_ID) + N
        # Causal: the first image's placeholders see only the first image, so they follow the order given.
        logits_swapped = model(**swapped).logits
        alone = processor(text="USER: <image>", images=[_image(1)], return_tensors="pt")
        torch.testing.assert_close(
            logits_swapped[0, :first_block_end], model(**alone).logits[0, :first_block_end], atol=1e-5, rtol=1e-5
        )
        assert not torch.allclose(logits_swapped, out.logits, atol=1e-4)


@pytest.mark.parametrize("images_layout", ["nested", "flat"])
def test_batch_with_a_row_without_image(processor, model, images_layout):
    rows = ["USER: hello there ASSISTANT: Hi.", "USER: <image>\nWhat? ASSISTANT: A cat."]
    # Images go per row as nested lists (`[]` for a row without one), or flat in the order of the
    # `<image>` tokens over the batch; `None` for a row is refused by the processor.
    images = [[], [_image(0)]] if images_layout == "nested" else [_image(0)]
    assert processor.tokenizer.padding_side == "right"  # the row-alone comparison below relies on it
    enc = processor(text=rows, images=images, padding=True, return_tensors="pt")
    assert (enc["input_ids"] == IMAGE_ID).sum(dim=1).tolist() == [0, N]
    assert tuple(enc["pixel_values"].shape) == (1, 3, 32, 32)
    with torch.no_grad():
        out = model(**enc, labels=_labels(enc))
        assert math.isfinite(out.loss.item())
        # Each row gives the same logits as alone: the image went to the row holding its placeholders.
        for row, (text, image) in enumerate(zip(rows, [None, _image(0)], strict=True)):
            single = processor(text=text, images=image, return_tensors="pt")
            length = single["input_ids"].shape[1]
            assert enc["input_ids"][row, :length].tolist() == single["input_ids"][0].tolist()
            torch.testing.assert_close(out.logits[row, :length], model(**single).logits[0], atol=1e-5, rtol=1e-5)


def test_text_only_forward(processor, model):
    enc = processor(text=["USER: hello ASSISTANT: Hi."], return_tensors="pt")
    assert "pixel_values" not in enc
    model.zero_grad()
    out = model(**enc, labels=_labels(enc))
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.grad is not None
    assert all(p.grad is None for p in model.model.vision_tower.parameters())
    assert all(p.grad is None for p in model.model.multi_modal_projector.parameters())
    model.zero_grad()
