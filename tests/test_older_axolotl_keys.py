"""Tokenizer, hub and precision keys of 2023 Axolotl configs (Axolotl's llama-2/gptq-lora.yml): what each means with
transformers 5, accepted where it can be honoured and refused by name where it cannot."""

from __future__ import annotations

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from tests.helpers import base_config


def test_the_fast_tokenizer_is_what_loads_and_the_slow_one_is_refused(tmp_path):
    assert validate_config(base_config(tmp_path, tokenizer_use_fast=True)).tokenizer_use_fast is True
    with pytest.raises(ConfigError, match=r"`tokenizer_use_fast`.*transformers 5 has only fast"):
        validate_config(base_config(tmp_path, tokenizer_use_fast=False))


@pytest.mark.parametrize(("legacy", "scheme"), [(True, "always"), (False, "first")])
def test_tokenizer_legacy_reaches_a_llama_tokenizer(tmp_path, legacy, scheme):
    from hellbender.models.loading import load_tokenizer

    cfg = validate_config(base_config(tmp_path, tokenizer_type="LlamaTokenizer", tokenizer_legacy=legacy))
    tokenizer = load_tokenizer(cfg)
    assert tokenizer.legacy is legacy
    # legacy: every piece of text between special tokens starts a word; otherwise only the start of the text
    assert tokenizer.backend_tokenizer.pre_tokenizer.prepend_scheme == scheme


def test_tokenizer_legacy_on_a_tokenizer_that_ignores_it_is_refused(tmp_path):
    from hellbender.models.loading import load_tokenizer

    cfg = validate_config(base_config(tmp_path, tokenizer_legacy=True))
    with pytest.raises(ConfigError, match=r"`tokenizer_legacy: true` cannot be honoured: the tokenizer `\w+`"):
        load_tokenizer(cfg)


def test_hf_use_auth_token_true_is_the_saved_token_and_false_is_refused(tmp_path):
    assert validate_config(base_config(tmp_path, hf_use_auth_token=True)).hf_use_auth_token is True
    with pytest.raises(ConfigError, match=r"`hf_use_auth_token`.*saved token whenever there is one"):
        validate_config(base_config(tmp_path, hf_use_auth_token=False))


def test_adam_eps_was_never_an_axolotl_key_and_points_to_adam_epsilon(tmp_path):
    with pytest.raises(ConfigError, match=r"`adam_eps` is not a config key\. Did you mean `adam_epsilon`\?"):
        validate_config(base_config(tmp_path, adam_eps=1e-5))


@pytest.mark.parametrize(("old", "new"), [("float16", "fp16"), ("bfloat16", "bf16")])
def test_axolotl_half_precision_without_amp_is_read_as_the_precision_key(tmp_path, old, new):
    """Axolotl's `float16: true` + `fp16: false` (half-precision weights without its mixed-precision wrapper) trains
    in that precision, as hellbender's `fp16` does; it was refused as two spellings disagreeing."""
    cfg = validate_config(base_config(tmp_path, **{old: True, new: False, "bf16" if new == "fp16" else "fp16": False}))
    assert getattr(cfg, new) is True
    same = validate_config(base_config(tmp_path, **{new: True}))
    assert cfg.model_dump() == same.model_dump()
