"""The tiny Qwen2.5-VL builder: what it saves loads back, and the processor and model work together on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from hellbender.models.fixes import qwen2_5_vl as qwen_fix
from hellbender.models.tiny_vlm import qwen2_5_vl
from tests.tiny_vlms import TINY_VLMS, training_labels

pytestmark = pytest.mark.parametrize("tiny_vlm", ["qwen2.5-vl"], indirect=True)  # the fixtures are in conftest.py

# 32x32 is resized to 16x16 (max_pixels=256): a 4x4 grid of 4-pixel patches, merged 2x2 into 4 soft tokens.
TOKENS_32x32 = 4
# 64x32 (width x height) is resized to 16x8: a 2x4 grid, 2 soft tokens.
TOKENS_64x32 = 2


def square(color=(200, 30, 30)):
    return Image.new("RGB", (32, 32), color)


def wide():
    image = Image.new("RGB", (64, 32), (10, 200, 30))
    image.putpixel((5, 5), (0, 0, 255))
    return image


def image_turn(*parts):
    return [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "apple"}]


def pad_runs(ids, pad_id):
    """Lengths of the consecutive runs of `pad_id` in a 1-D id list."""
    runs, current = [], 0
    for token in [*ids, None]:
        if token == pad_id:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs


def test_saved_directory_loads_back_with_consistent_ids(tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.utils import is_torchvision_available

    saved, processor, model = tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model
    assert isinstance(processor, Qwen2_5_VLProcessor)
    # AutoImageProcessor picks the torchvision backend where torchvision is installed (the GPU machines).
    backend = "Qwen2VLImageProcessor" if is_torchvision_available() else "Qwen2VLImageProcessorPil"
    assert type(processor.image_processor).__name__ == backend
    assert processor.image_processor.patch_size == qwen2_5_vl.PATCH_SIZE
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert json.loads((saved / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"

    tokenizer = AutoTokenizer.from_pretrained(saved)
    ids = dict(
        zip(qwen2_5_vl.VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(qwen2_5_vl.VISION_TOKENS)), strict=True)
    )
    assert len(set(ids.values())) == 4 and tokenizer.unk_token_id not in ids.values()
    assert processor.image_token == "<|image_pad|>" and processor.video_token == "<|video_pad|>"
    assert processor.image_token_id == ids["<|image_pad|>"] == model.config.image_token_id
    assert processor.video_token_id == ids["<|video_pad|>"] == model.config.video_token_id
    assert model.config.vision_start_token_id == ids["<|vision_start|>"]
    assert model.config.vision_end_token_id == ids["<|vision_end|>"]
    assert model.config.text_config.vocab_size == len(tokenizer) == len(processor.tokenizer)
    assert tokenizer.chat_template == processor.chat_template == qwen2_5_vl.CHAT_TEMPLATE

    text = model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert model.config.vision_config.out_hidden_size == text.hidden_size

    from transformers import AutoProcessor

    if is_torchvision_available():  # the stock class, with the video processor `build` describes
        stock = AutoProcessor.from_pretrained(saved)
        assert type(stock) is type(processor) is Qwen2_5_VLProcessor
        assert type(stock.video_processor).__name__ == "Qwen2VLVideoProcessor"
        assert stock.video_processor.patch_size == qwen2_5_vl.PATCH_SIZE
    else:  # why `load_processor` exists: the stock processor always loads a video processor needing torchvision
        with pytest.raises(ImportError, match="[Tt]orchvision"):
            AutoProcessor.from_pretrained(saved)


def test_image_only_processor_matches_and_refuses_videos(tiny_vlm_dir, tiny_vlm_processor):
    """The torchvision-free processor (what `load_processor` returns without torchvision) gives the same ids, grids
    and attributes as `load_processor` here, and refuses videos instead of dropping them."""
    saved, processor = tiny_vlm_dir, tiny_vlm_processor
    image_only = qwen_fix.ImageOnlyQwen2_5_VLProcessor.from_pretrained(saved)
    assert image_only.get_attributes() == ["image_processor", "tokenizer"]
    for name in ("image_token", "image_token_id", "video_token", "video_token_id", "chat_template"):
        assert getattr(image_only, name) == getattr(processor, name), name
    text = processor.apply_chat_template(image_turn({"type": "image"}), tokenize=False)
    ours, theirs = image_only(text=[text], images=[square()]), processor(text=[text], images=[square()])
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["image_grid_thw"].tolist() == theirs["image_grid_thw"].tolist()
    with pytest.raises(ValueError, match="no video processor"):
        image_only(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[[square(), square()]])


def test_chat_template_renders_parts_and_strings(tiny_vlm_processor):
    processor = tiny_vlm_processor
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": square()}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "apple"}]},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
        "<|im_start|>assistant\napple<|im_end|>\n"
    )
    assert processor.apply_chat_template(messages, tokenize=False) == expected
    assert processor.tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = processor.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("What is it?<|im_end|>\n<|im_start|>assistant\n")

    with pytest.raises(Exception, match="Unsupported content part type: audio"):
        processor.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)


def test_processor_expands_the_image_placeholder(tiny_vlm_processor):
    processor = tiny_vlm_processor
    text = processor.apply_chat_template(
        image_turn({"type": "image"}, {"type": "text", "text": "What is it?"}), tokenize=False
    )
    batch = processor(text=[text], images=[square()], return_tensors="pt")

    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    patch_dim = 3 * qwen2_5_vl.TEMPORAL_PATCH_SIZE * qwen2_5_vl.PATCH_SIZE**2
    assert tuple(batch["pixel_values"].shape) == (16, patch_dim)

    ids = batch["input_ids"][0].tolist()
    tokenizer = processor.tokenizer
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    i = ids.index(start)
    assert ids[i + 1 : i + 2 + TOKENS_32x32] == [processor.image_token_id] * TOKENS_32x32 + [end]
    # Exactly the ids of the template text with the placeholder repeated once per soft token.
    expanded = text.replace("<|image_pad|>", "<|image_pad|>" * TOKENS_32x32)
    assert ids == tokenizer(expanded)["input_ids"]
    assert batch["mm_token_type_ids"][0].tolist() == [int(t == processor.image_token_id) for t in ids]

    # The same rendering and expansion through the processor's chat template with the image inside the message.
    chat = processor.apply_chat_template(
        image_turn({"type": "image", "image": square()}, {"type": "text", "text": "What is it?"}),
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert torch.equal(chat["input_ids"], batch["input_ids"])
    assert torch.equal(chat["pixel_values"], batch["pixel_values"])


def test_two_images_in_one_row(tiny_vlm_processor, tiny_vlm_model):
    processor, model = tiny_vlm_processor, tiny_vlm_model
    text = processor.apply_chat_template(
        image_turn({"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}), tokenize=False
    )
    batch = processor(text=[text], images=[square(), wide()], return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert batch["pixel_values"].shape[0] == 16 + 8
    assert pad_runs(batch["input_ids"][0].tolist(), processor.image_token_id) == [TOKENS_32x32, TOKENS_64x32]
    loss = model(**batch, labels=training_labels(batch, processor, TINY_VLMS["qwen2.5-vl"])).loss
    assert torch.isfinite(loss)
    loss.backward()
    model.zero_grad()


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_batch_mixing_rows_with_and_without_images(tiny_vlm_processor, layout):
    """Images are matched to `<|image_pad|>` placeholders in reading order, so a row without an image simply has
    none: pass a flat list of the batch's images, or one list per row with `[]` for an image-free row. (That each row
    then gives the logits it gives alone is tested for every family in test_tiny_vlms.py.)"""
    processor = tiny_vlm_processor
    text_only = processor.apply_chat_template([{"role": "user", "content": "just text here"}], tokenize=False)
    with_image = processor.apply_chat_template(
        image_turn({"type": "image"}, {"type": "text", "text": "hi"}), tokenize=False
    )
    images = [square()] if layout == "flat" else [[], [square()]]
    batch = processor(text=[text_only, with_image], images=images, padding=True, return_tensors="pt")

    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert (batch["input_ids"] == processor.image_token_id).sum(dim=1).tolist() == [0, TOKENS_32x32]


def test_mrope_positions_need_mm_token_type_ids(tiny_vlm_processor, tiny_vlm_model):
    """A collator must keep `mm_token_type_ids`: without it the model silently uses 1-D positions for the image."""
    processor, model = tiny_vlm_processor, tiny_vlm_model
    text = processor.apply_chat_template(image_turn({"type": "image"}, {"type": "text", "text": "hi"}), tokenize=False)
    batch = processor(text=[text], images=[square()], return_tensors="pt")
    without = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        full, flat = model(**batch).logits, model(**without).logits
    first_image = batch["input_ids"][0].tolist().index(processor.image_token_id)
    # Same positions up to the first image token, different after it (the 2-D grid positions differ from 1-D).
    torch.testing.assert_close(full[0, : first_image + 1], flat[0, : first_image + 1])
    assert not torch.allclose(full[0, first_image + 1 :], flat[0, first_image + 1 :], atol=1e-4)
