"""Vision-language families hellbender cannot train are refused at start, by name and with the reason, before any
processor or weights load."""

from __future__ import annotations

import json

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.processor import load_processor
from tests.helpers import base_config


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"model_type": "mllama"}, "Mllama (Llama 3.2 Vision) feeds images through cross-attention"),
        ({"model_type": "t5gemma2", "is_encoder_decoder": True}, "t5gemma2: it is an encoder-decoder model"),
        ({"model_type": "shieldgemma2"}, "ShieldGemma 2 is an image-safety classifier"),
        ({"model_type": "git"}, "GIT puts the image features in front of the text"),
        ({"model_type": "fuyu"}, "Fuyu's processor puts the image in front of each text"),
        ({"model_type": "got_ocr2"}, "GOT-OCR2's processor refuses images grouped per text"),
        ({"model_type": "pp_chart2table"}, "PP-Chart2Table's processor expands no image placeholder"),
        ({"model_type": "kosmos-2"}, "Kosmos-2's processor writes its own image prompt in front of each text"),
        ({"model_type": "kosmos-2.5"}, "Kosmos-2.5's processor writes its own image prompt in front of each text"),
        ({"model_type": "blip-2"}, "BLIP-2's processor puts the Q-Former's query tokens in front"),
        ({"model_type": "florence2", "is_encoder_decoder": True}, "florence2: it is an encoder-decoder model"),
    ],
)
def test_an_unsupported_vision_family_is_refused_by_name(tmp_path, config, expected) -> None:
    from hellbender.models.tiny import build_tiny_tokenizer

    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights, no processor: the refusal comes first
    build_tiny_tokenizer().save_pretrained(tmp_path)
    cfg = validate_config(base_config(tmp_path, base_model=str(tmp_path), processor_type="AutoProcessor"))
    with pytest.raises(ConfigError, match="is not supported yet as a vision-language model") as caught:
        load_processor(cfg, str(tmp_path))
    assert expected in str(caught.value)


def test_a_decoder_only_vision_family_is_not_refused(tmp_path) -> None:
    from hellbender.models.fixes import unsupported_reason

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "is_encoder_decoder": False}))
    assert unsupported_reason(str(tmp_path)) is None
