"""The tiny LLaVA-1.5 built in code: it saves, loads through the Auto classes (no torchvision), renders its
chat template, expands `<image>` into exactly the number of tokens the model consumes, and trains."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hellbender.models.tiny_vlm import llava

pytestmark = pytest.mark.parametrize("tiny_vlm", ["llava"], indirect=True)  # the fixtures are in conftest.py

IMAGE_ID = 512  # the first id after the tiny tokenizer's 512 base tokens + its specials <|endoftext|>, <|pad|>, ...
N = llava.IMAGE_SEQ_LENGTH  # 16 = (32 // 8) ** 2 patches; CLIP's CLS is counted (+1) and dropped ("default")


def _image(seed: int, size=(40, 50)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _ids(processor, text: str) -> list[int]:
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _labels(enc, image_id: int = IMAGE_ID) -> torch.Tensor:
    labels = enc["input_ids"].clone()
    labels[(labels == image_id) | (enc["attention_mask"] == 0)] = -100
    return labels


def test_processor_and_model_load_back_consistently(tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model):
    from transformers import AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor

    llava_dir, processor, model = tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model
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


def test_chat_template_renders_llava_turns(tiny_vlm_processor):
    processor = tiny_vlm_processor
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


def test_processor_expands_each_image_token(tiny_vlm_processor):
    processor = tiny_vlm_processor
    enc = processor(text="USER: <image>\nhi", images=_image(0), return_tensors="pt")
    expected = _ids(processor, "USER: ") + [IMAGE_ID] * N + _ids(processor, "\nhi")
    assert enc["input_ids"][0].tolist() == expected
    assert tuple(enc["pixel_values"].shape) == (1, 3, 32, 32)  # any input size is resized + cropped to 32 x 32


def test_two_images_in_one_row_fill_their_placeholders_in_order(tiny_vlm_processor, tiny_vlm_model):
    processor, model = tiny_vlm_processor, tiny_vlm_model
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
def test_a_batch_holds_pixels_only_for_its_images(tiny_vlm_processor, images_layout):
    """A row without an image adds no pixel values. (The model side of such a batch is tested for every family in
    test_tiny_vlms.py.)"""
    processor = tiny_vlm_processor
    rows = ["USER: hello there ASSISTANT: Hi.", "USER: <image>\nWhat? ASSISTANT: A cat."]
    # Images go per row as nested lists (`[]` for a row without one), or flat in the order of the
    # `<image>` tokens over the batch; `None` for a row is refused by the processor.
    images = [[], [_image(0)]] if images_layout == "nested" else [_image(0)]
    enc = processor(text=rows, images=images, padding=True, return_tensors="pt")
    assert (enc["input_ids"] == IMAGE_ID).sum(dim=1).tolist() == [0, N]
    assert tuple(enc["pixel_values"].shape) == (1, 3, 32, 32)
