"""Encoder families in transformers' causal-LM mapping (BERT and kin) attend both ways as built: hellbender makes
each listed family causal when it reads the config, or refuses it by name. Checked with the causality probe: a
changed later token must leave the earlier positions' logits unchanged."""

from __future__ import annotations

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.fixes.encoders import CAUSAL_SWITCHES, REFUSED, make_causal
from hellbender.models.loading import load_model
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import base_config, model_survey

survey = model_survey()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _tiny(model_type: str, tokenizer, causal: bool):
    from transformers import AutoModelForCausalLM

    config = survey.tiny_config(model_type, tokenizer)
    if model_type == "xmod":  # X-MOD needs a language for its adapters
        config.default_language = config.languages[0]
    if causal:
        make_causal(config, {})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", sorted(CAUSAL_SWITCHES))
def test_each_listed_encoder_family_sees_the_future_as_built_and_not_after_its_switch(model_type, tokenizer):
    assert survey.sees_the_future(_tiny(model_type, tokenizer, causal=False)) is True
    assert survey.sees_the_future(_tiny(model_type, tokenizer, causal=True)) is False


def test_a_bert_model_loaded_for_training_is_causal_and_says_so(tmp_path, tokenizer, caplog):
    model_dir = tmp_path / "bert"
    _tiny("bert", tokenizer, causal=False).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = validate_config(base_config(tmp_path, base_model=str(model_dir)))
    with caplog.at_level("WARNING", logger="hellbender"):
        model = load_model(cfg, tokenizer)
    assert model.config.is_decoder is True
    assert survey.sees_the_future(model) is False
    assert any("`bert` is an encoder family" in r.message and "`is_decoder: true`" in r.message for r in caplog.records)


def test_a_causal_model_is_loaded_unchanged(tmp_path, tokenizer, caplog):
    """GPT-NeoX's config says `is_decoder: false`, and it is causal by construction: nothing is switched."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    assert config.is_decoder is False
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    tokenizer.save_pretrained(tmp_path / "neox")
    cfg = validate_config(base_config(tmp_path, base_model=str(tmp_path / "neox")))
    with caplog.at_level("WARNING", logger="hellbender"):
        model = load_model(cfg, tokenizer)
    assert model.config.is_decoder is False
    assert survey.sees_the_future(model) is False
    assert not any("encoder family" in r.message for r in caplog.records)


def test_cpmant_is_refused_by_name(tokenizer):
    assert "cpmant" in REFUSED
    config = survey.tiny_config("cpmant", tokenizer)
    with pytest.raises(ConfigError, match=r"`cpmant` model, which hellbender cannot train as a causal language model"):
        make_causal(config, {})


def test_an_override_that_turns_the_switch_off_is_refused(tokenizer):
    config = survey.tiny_config("roberta", tokenizer)
    with pytest.raises(ConfigError, match=r"`overrides_of_model_config.is_decoder: False`.*remove the override"):
        make_causal(config, {"is_decoder": False})


def test_xmod_without_a_default_language_is_refused_and_with_one_trains_causally(tmp_path, tokenizer):
    """X-MOD picks its per-language adapters from `default_language`; without one its forward fails."""
    from transformers import AutoModelForCausalLM

    config = survey.tiny_config("xmod", tokenizer)
    assert config.default_language is None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "xmod")
    tokenizer.save_pretrained(tmp_path / "xmod")
    cfg = validate_config(base_config(tmp_path, base_model=str(tmp_path / "xmod")))
    with pytest.raises(ConfigError, match=r"`overrides_of_model_config: \{default_language: <language>\}`.*`en_XX`"):
        load_model(cfg, tokenizer)
    overrides = {"overrides_of_model_config": {"default_language": "en_XX"}}
    model = load_model(
        validate_config(base_config(tmp_path, base_model=str(tmp_path / "xmod"), **overrides)), tokenizer
    )
    assert survey.sees_the_future(model) is False
