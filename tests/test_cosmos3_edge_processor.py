"""Cosmos3 Edge's loaded processor returns `mm_token_type_ids`, which its model requires (`fixes/cosmos3_edge.py`);
other families' processors keep their own setting."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hellbender.models.fixes import adjust_processor


def model_dir(tmp_path, model_type: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


def test_cosmos3_edge_processor_returns_the_token_types(tmp_path):
    processor = SimpleNamespace(return_mm_token_type_ids=False)
    assert adjust_processor(model_dir(tmp_path, "cosmos3_edge"), processor).return_mm_token_type_ids is True


@pytest.mark.parametrize("model_type", ["lfm3_vl", "llava"])
def test_other_processors_keep_their_setting(tmp_path, model_type):
    processor = SimpleNamespace(return_mm_token_type_ids=False)
    assert adjust_processor(model_dir(tmp_path, model_type), processor).return_mm_token_type_ids is False


def test_the_stock_class_still_needs_it():
    """The fix exists because the class defaults to False; when transformers turns it on, drop the fix."""
    from transformers import Cosmos3EdgeProcessor

    assert Cosmos3EdgeProcessor.return_mm_token_type_ids is False
