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


def test_row_expansion_asks_the_loaded_ovis2_processor_for_arrays(tmp_path):
    import json

    from PIL import Image

    from hellbender.data.formats.multimodal_chat import expand
    from hellbender.models.fixes import adjust_processor

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "ovis2"}))
    processor = adjust_processor(str(tmp_path), _tiny_ovis2_processor())
    image = Image.new("RGB", (32, 32), "red")
    ids = expand(processor, "look: <image> done", [image])
    atom = processor.tokenizer.convert_tokens_to_ids("<IMG_ATOM>")
    assert ids.count(atom) == 16
    assert all(isinstance(i, int) for i in ids)
    with pytest.raises(AttributeError, match="tolist"):  # the stock processor, called as hellbender calls it
        _tiny_ovis2_processor()(text=["look: <image> done"], images=[[image]], add_special_tokens=False)


def test_other_processors_get_no_extra_arguments(tmp_path):
    import json

    from hellbender.models.fixes import adjust_processor
    from hellbender.models.tiny_vlm.llava import build_processor, build_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    processor = adjust_processor(str(tmp_path), build_processor(build_tokenizer()))
    assert not hasattr(processor, "hellbender_row_call_kwargs")
