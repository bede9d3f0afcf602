"""Families transformers lists as causal LMs that hellbender refuses by name (Gemma 4 assistants, MusicGen), each
with a check that the reason still holds in the installed transformers; and a checkpoint whose config type the auto
class does not map (Emu3's text model) loads through the class its `architectures` names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.architecture_class import class_for_config
from hellbender.models.loading import load_model
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import base_config, model_survey

survey = model_survey()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _saved(model_type: str, tokenizer, directory: Path) -> Path:
    torch.manual_seed(0)
    survey.build(model_type, directory)
    return directory


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_a_gemma4_assistant_needs_its_target_and_is_refused_by_name(tmp_path, tokenizer, model_type):
    model_dir = _saved(model_type, tokenizer, tmp_path / model_type)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="shared_kv_states cannot be None"):  # why it is refused
        model(input_ids=torch.tensor([[5, 6, 7]]))
    cfg = validate_config(base_config(tmp_path, base_model=str(model_dir)))
    with pytest.raises(ConfigError, match=rf"`{model_type}` model, a Gemma 4 assistant .* Train the target model"):
        load_model(cfg, tokenizer)


@pytest.mark.parametrize("model_type", ["musicgen", "musicgen_melody"])
def test_a_musicgen_decoder_reads_audio_codes_and_is_refused_by_name(tmp_path, tokenizer, model_type):
    model_dir = _saved(model_type, tokenizer, tmp_path / model_type)
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(model_dir)
    assert saved.num_codebooks > 1  # parallel codebook streams, one embedding table each
    model = class_for_config(AutoModelForCausalLM, saved).from_pretrained(model_dir)
    assert len(model.get_input_embeddings()) == saved.num_codebooks
    cfg = validate_config(base_config(tmp_path, base_model=str(model_dir)))
    with pytest.raises(ConfigError, match=rf"`{model_type}_decoder` model, MusicGen's decoder of audio-codec codes"):
        load_model(cfg, tokenizer)


def test_a_text_model_the_auto_class_does_not_map_loads_through_its_named_class(tmp_path, tokenizer):
    """Emu3's causal LM saves `emu3_text_model`, which `AutoModelForCausalLM` refuses; hellbender and its reload use
    `Emu3ForCausalLM`, which `architectures` names."""
    from transformers import AutoConfig, Emu3ForCausalLM, LlamaConfig

    model_dir = _saved("emu3", tokenizer, tmp_path / "emu3")
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_pretrained(model_dir)
    assert class_for_config(AutoModelForCausalLM, AutoConfig.from_pretrained(model_dir)) is Emu3ForCausalLM
    model = load_model(validate_config(base_config(tmp_path, base_model=str(model_dir))), tokenizer)
    assert isinstance(model, Emu3ForCausalLM)
    # a mapped config keeps the auto class; a named class built from another config type is not taken
    assert class_for_config(AutoModelForCausalLM, LlamaConfig()) is AutoModelForCausalLM
    mismatched = AutoConfig.from_pretrained(model_dir)
    mismatched.architectures = ["LlamaForCausalLM"]
    assert class_for_config(AutoModelForCausalLM, mismatched) is AutoModelForCausalLM
