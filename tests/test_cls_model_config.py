"""`cls_model_config`: the named transformers config class reads the model's config (the section of its own model type
in a config of several models); names that are not config classes, classes the model class is not built from, and
checkpoints of another model are refused."""

from __future__ import annotations

import json

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.loading import model_config
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses


def test_the_named_class_reads_the_config_and_the_run_trains(tmp_path, tiny_model_path):
    from transformers import LlamaConfig

    cfg = validate_config(
        base_config(tmp_path, cls_model_config="LlamaConfig", model_type="LlamaForCausalLM", max_steps=2)
    )
    assert cfg.cls_model_config == "LlamaConfig"
    assert type(model_config(cfg, tiny_model_path)) is LlamaConfig
    train(cfg)
    assert sorted(logged_losses(cfg.output_dir)) == [1, 2]


def test_a_text_config_reads_its_section_of_a_vision_language_config(tmp_path):
    """Gemma 3's checkpoints with a vision tower keep the text model's settings under `text_config`: read with
    `Gemma3TextConfig`, the text model's settings come back, not the defaults of the class."""
    from transformers import Gemma3Config, Gemma3TextConfig

    composite = Gemma3Config(text_config={"hidden_size": 96, "num_hidden_layers": 3, "vocab_size": 600})
    composite.save_pretrained(tmp_path / "gemma3")
    assert json.loads((tmp_path / "gemma3" / "config.json").read_text())["model_type"] == "gemma3"
    cfg = validate_config(base_config(tmp_path, cls_model_config="Gemma3TextConfig", model_type="Gemma3ForCausalLM"))
    config = model_config(cfg, tmp_path / "gemma3")
    assert type(config) is Gemma3TextConfig
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (96, 3, 600)


def test_a_checkpoint_of_another_model_is_refused_when_it_loads(tmp_path, tiny_model_path):
    cfg = validate_config(base_config(tmp_path, cls_model_config="Gemma3TextConfig", model_type="Gemma3ForCausalLM"))
    with pytest.raises(
        ConfigError,
        match=r"`cls_model_config: Gemma3TextConfig` reads configs of model type "
        r"`gemma3_text`, and the config.json of .* describes `llama`",
    ):
        model_config(cfg, tiny_model_path)


def test_auto_config_is_the_default_reader(tmp_path, tiny_model_path):
    cfg = validate_config(base_config(tmp_path, cls_model_config="AutoConfig"))
    assert type(model_config(cfg, tiny_model_path)).__name__ == "LlamaConfig"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"cls_model_config": "LlamaModel"}, r"`LlamaModel` is a transformers name, but not a config class"),
        ({"cls_model_config": "LlamaConfg"}, r"`LlamaConfg` is not a name transformers exports"),
        (
            {"cls_model_config": "LlamaConfig", "model_type": "Gemma3ForCausalLM"},
            r"`model_type: Gemma3ForCausalLM` is built from a `Gemma3TextConfig`. Set `cls_model_config: "
            r"Gemma3TextConfig`",
        ),
        (
            {"cls_model_config": "SiglipVisionConfig"},
            r"`model_type: AutoModelForCausalLM` has no model built from that config class",
        ),
    ],
)
def test_names_that_cannot_read_this_model_are_refused_at_validation(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_an_auto_class_accepts_a_config_class_it_maps(tmp_path):
    cfg = validate_config(base_config(tmp_path, cls_model_config="Gemma3TextConfig"))
    assert cfg.model_type == "AutoModelForCausalLM"
