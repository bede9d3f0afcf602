"""Ovis2's processor expands an image placeholder only when asked for arrays (models/fixes/ovis2.py): a row's
per-row expansion asks for them, and gets the grid's image tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def _tiny_ovis2_processor():
    from transformers import Ovis2ImageProcessorPil, Ovis2Processor

    from hellbender.models.tiny import build_tiny_tokenizer

    indicators = ["<IMG_ATOM>", "<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
    tokenizer = build_tiny_tokenizer(indicators, image_token="<image>")
    image_processor = Ovis2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    return Ovis2Processor(image_processor, tokenizer, image_seq_length=16)


def test_row_expansion_asks_ovis2_for_arrays():
    from PIL import Image

    from hellbender.data.formats.multimodal_chat import expand
    from hellbender.models.fixes import expansion_kwargs

    processor = _tiny_ovis2_processor()
    assert expansion_kwargs(processor) == {"return_tensors": "np"}
    image = Image.new("RGB", (32, 32), "red")
    ids = expand(processor, "look: <image> done", [image])
    atom = processor.tokenizer.convert_tokens_to_ids("<IMG_ATOM>")
    assert ids.count(atom) == 16
    assert all(isinstance(i, int) for i in ids)


def test_other_processors_get_no_extra_arguments():
    from hellbender.models.fixes import expansion_kwargs
    from hellbender.models.tiny_vlm.llava import build_processor, build_tokenizer

    assert expansion_kwargs(build_processor(build_tokenizer())) == {}
