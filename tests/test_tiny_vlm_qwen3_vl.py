"""The tiny Qwen3-VL builder: what it saves loads back as a stock Qwen3-VL directory, the torchvision-free processor
refuses videos, and the model builds its 3-D positions only from `mm_token_type_ids`."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from hellbender.models.fixes import qwen3_vl as qwen3_fix
from hellbender.models.tiny_vlm import qwen2_5_vl

pytestmark = pytest.mark.parametrize("tiny_vlm", ["qwen3-vl"], indirect=True)  # the fixtures are in conftest.py


def image_turn(*parts):
    return [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "apple"}]


def test_saved_directory_loads_back_as_stock_qwen3_vl(tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model):
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    saved, processor, model = tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model
    assert isinstance(processor, Qwen3VLProcessor) and isinstance(model, Qwen3VLForConditionalGeneration)
    config = json.loads((saved / "processor_config.json").read_text())
    assert config["processor_class"] == "Qwen3VLProcessor"
    assert config["video_processor"]["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert processor.image_token_id == model.config.image_token_id
    assert processor.video_token_id == model.config.video_token_id
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    text = model.config.text_config
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2
    if is_torchvision_available():  # the stock class, with its video processor
        assert type(AutoProcessor.from_pretrained(saved)) is Qwen3VLProcessor
    else:  # why `load_processor` exists: the stock processor always loads a video processor needing torchvision
        with pytest.raises(ImportError, match="[Tt]orchvision"):
            AutoProcessor.from_pretrained(saved)


def test_image_only_processor_refuses_videos(tiny_vlm_dir, tiny_vlm_processor):
    image_only = qwen3_fix.ImageOnlyQwen3VLProcessor.from_pretrained(tiny_vlm_dir)
    assert image_only.get_attributes() == ["image_processor", "tokenizer"]
    square = Image.new("RGB", (32, 32), (200, 30, 30))
    text = tiny_vlm_processor.apply_chat_template(image_turn({"type": "image"}), tokenize=False)
    ours, theirs = image_only(text=[text], images=[square]), tiny_vlm_processor(text=[text], images=[square])
    assert ours["input_ids"] == theirs["input_ids"]
    with pytest.raises(ValueError, match="no video processor"):
        image_only(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[[square, square]])


def test_mrope_positions_need_mm_token_type_ids(tiny_vlm_processor, tiny_vlm_model):
    """A collator must keep `mm_token_type_ids`: the model's 3-D image positions come from it (Qwen3-VL refuses a
    batch without it, where Qwen2.5-VL silently falls back to 1-D positions)."""
    processor, model = tiny_vlm_processor, tiny_vlm_model
    text = processor.apply_chat_template(image_turn({"type": "image"}, {"type": "text", "text": "hi"}), tokenize=False)
    enc = processor(text=[text], images=[Image.new("RGB", (32, 32), (10, 200, 30))], return_tensors="pt")
    assert enc["mm_token_type_ids"].sum() == (enc["input_ids"] == processor.image_token_id).sum() == 4
    assert processor.image_token == qwen2_5_vl.IMAGE_PAD  # the tokenizer is the tiny Qwen2.5-VL's
    with torch.no_grad():
        assert torch.isfinite(model(**enc).logits).all()
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            model(**{k: v for k, v in enc.items() if k != "mm_token_type_ids"})
