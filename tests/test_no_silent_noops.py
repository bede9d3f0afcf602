"""Keys that used to be accepted and then did nothing: each is now honoured or refused with its reason."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError, DataError
from tests.conftest import write_jsonl
from tests.helpers import base_config


def streamed(tmp_path: Path, **overrides) -> dict:
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "some words"}] * 4)
    return base_config(tmp_path, datasets=[], pretraining_dataset=[{"path": str(text)}], max_steps=2, **overrides)


def test_streamed_text_is_packed_and_validate_says_so(tmp_path):
    assert validate_config(streamed(tmp_path)).sample_packing is True
    assert validate_config(streamed(tmp_path, streaming=False)).sample_packing is False


def test_sample_packing_false_on_a_stream_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`sample_packing: false` cannot be honoured with a streamed"):
        validate_config(streamed(tmp_path, sample_packing=False))


FSDP = dict(fsdp_version=2, adapter="lora", lora_target_linear=True)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"fsdp_config": {"use_orig_params": False}}, r"`fsdp_config.use_orig_params: false` cannot be honoured"),
        (
            {"fsdp_config": {"fsdp_sync_module_states": False, "cpu_ram_efficient_loading": True}},
            r"`fsdp_config.sync_module_states: false` contradicts `cpu_ram_efficient_loading: true`",
        ),
        ({"fsdp_final_state_dict_type": "SHARDED_STATE_DICT"}, r"the final model is always saved whole"),
    ],
)
def test_fsdp1_keys_that_fsdp2_cannot_honour_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **FSDP, **keys))


@pytest.mark.parametrize(
    "keys",
    [
        {"fsdp_config": {"use_orig_params": True, "sync_module_states": True}},
        {"fsdp_config": {"sync_module_states": False}},  # each process reads the weights itself: what false means
        {"fsdp_config": {}, "fsdp_final_state_dict_type": "FULL_STATE_DICT"},
    ],
)
def test_fsdp1_keys_that_describe_what_fsdp2_does_are_accepted(tmp_path, keys):
    validate_config(base_config(tmp_path, **FSDP, **keys))


def pretokenized_vlm_config(tmp_path: Path, image_base_dir: str) -> dict:
    rows = write_jsonl(tmp_path / "pre.jsonl", [{"_mm_text": "x", "images": [], "input_ids": [1], "labels": [1]}])
    entry = {"path": str(rows), "type": "multimodal_pretrain", "image_base_dir": image_base_dir}
    return base_config(
        tmp_path,
        base_model="hellbender/tiny-qwen2.5-vl",
        processor_type="AutoProcessor",
        datasets=[entry],
        skip_prepare_dataset=True,
    )


def test_pretokenized_image_rows_check_image_base_dir_like_every_other_route(tmp_path):
    from hellbender.data.pretokenized_multimodal import pretokenized_multimodal_rows

    cfg = validate_config(pretokenized_vlm_config(tmp_path, str(tmp_path / "no-such-dir")))
    with pytest.raises(DataError, match=r"datasets\[0\].*`image_base_dir: .*no-such-dir` does not exist"):
        pretokenized_multimodal_rows(cfg)


def test_pretokenized_image_rows_expand_the_home_directory(tmp_path, monkeypatch):
    from hellbender.data.pretokenized_multimodal import pretokenized_multimodal_rows

    (tmp_path / "home" / "pictures").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = validate_config(pretokenized_vlm_config(tmp_path, "~/pictures"))
    rows = pretokenized_multimodal_rows(cfg)
    assert rows.policy.base_dir == tmp_path / "home" / "pictures"


def test_a_template_that_cannot_render_a_plain_exchange_is_reported(caplog, tiny_tokenizer):
    from hellbender.use.chat import end_of_turn_id

    class Refuses:
        def apply_chat_template(self, messages, tokenize=False):
            raise TypeError("this template wants a system message first")

    with caplog.at_level(logging.WARNING, logger="hellbender"):
        assert end_of_turn_id(tiny_tokenizer, Refuses(), multimodal=False) is None
    assert "could not render a plain user / assistant exchange (TypeError: this template wants a system message" in (
        caplog.text
    )
