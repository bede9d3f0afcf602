"""The Qwen-VL processors load without torchvision for every model type that uses them (Qwen2-VL, and Qwen3-VL's
processor for Qwen3-VL MoE and Qwen3.5), not only for the type the fix was written for: a checkpoint directory of
each type gives an image-only processor that expands an image into its soft tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hellbender.config import validate_config
from hellbender.models.fixes import processor_loader, qwen2_vl, qwen3_vl
from hellbender.models.processor import load_processor
from hellbender.models.tiny_vlm import qwen2_5_vl as tiny_qwen
from tests.helpers import base_config
from tests.tiny_vlms import TINY_VLMS


def test_the_qwen3_vl_processor_fix_covers_every_type_that_uses_its_processor() -> None:
    assert {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"} <= set(qwen3_vl.MODEL_TYPES)
    assert qwen2_vl.MODEL_TYPES == ("qwen2_vl",)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="the stock processor loads there")
@pytest.mark.parametrize(
    "model_type, image_only",
    [("qwen2_vl", qwen2_vl.ImageOnlyQwen2VLProcessor), ("qwen3_5", qwen3_vl.ImageOnlyQwen3VLProcessor)],
)
def test_a_directory_of_each_type_loads_its_processor_without_torchvision(tmp_path, model_type, image_only) -> None:
    from transformers import AutoProcessor, Qwen2VLImageProcessorPil

    tokenizer = tiny_qwen.build_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=256
    )
    image_only(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tiny_qwen.CHAT_TEMPLATE
    ).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ImportError, match="(?i)torchvision"):  # what a user gets from the stock path here
        AutoProcessor.from_pretrained(tmp_path)
    assert processor_loader(str(tmp_path)) is not None
    cfg = validate_config(base_config(tmp_path, base_model=str(tmp_path), processor_type="AutoProcessor"))
    processor = load_processor(cfg, str(tmp_path))
    assert isinstance(processor, image_only)
    row = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(row, tokenize=False)
    batch = processor(text=[text], images=[TINY_VLMS["qwen2.5-vl"].image(0)], return_tensors="pt")
    image_pad = tokenizer.convert_tokens_to_ids(tiny_qwen.IMAGE_PAD)
    assert int((batch["input_ids"] == image_pad).sum()) == 4  # 32 x 32 -> 16 x 16 -> 4 x 4 patches merged 2 x 2
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
