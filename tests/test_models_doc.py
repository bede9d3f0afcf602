"""docs/models.md is what scripts/model_survey.py renders from the committed docs/models.json, and lists every
causal-LM architecture of the installed transformers (so a transformers upgrade that adds one shows up here)."""

from __future__ import annotations

from tests.helpers import model_survey

survey = model_survey()


def test_models_doc_is_rendered_from_the_survey_results() -> None:
    expected = survey.render(survey.load_results(), survey.causal_lm_types(), survey.image_text_to_text_types())
    assert survey.DOC.read_text() == expected, "run `python scripts/model_survey.py --render` and commit docs/models.md"


def test_every_installed_causal_lm_and_image_text_to_text_architecture_has_a_row() -> None:
    rows = {line.split("|")[1].strip() for line in survey.DOC.read_text().splitlines() if line.startswith("| ")}
    missing = sorted((set(survey.causal_lm_types()) | set(survey.image_text_to_text_types())) - rows)
    assert not missing, f"docs/models.md lacks {missing}: survey them or run `scripts/model_survey.py --render`"


def test_a_type_without_results_reads_not_surveyed_and_a_failure_names_its_error() -> None:
    results = {
        "llama": {
            "build": {"status": "ok", "moe": False},
            "lora": {"status": "ok", "lora_modules": 14, "experts_adapted": False},
            "packing": {"status": "ValueError: packing broke"},
            "full": {"status": "ok"},
        }
    }
    doc = survey.render(results, ["llama", "mistral"])
    assert "| llama | ok (14 modules) | fails | ok | packing: `ValueError: packing broke` |" in doc
    assert f"| mistral | {survey.NOT_SURVEYED} | {survey.NOT_SURVEYED} | {survey.NOT_SURVEYED} |  |" in doc
    assert "Surveyed: 1 of 2 architectures; all three modes pass for 0." in doc


def test_moe_without_adapted_experts_is_noted() -> None:
    results = {
        "mixtral": {
            "build": {"status": "ok", "moe": True},
            **{m: {"status": "ok", "lora_modules": 8, "experts_adapted": False} for m in ("lora", "packing")},
            "full": {"status": "ok"},
        }
    }
    assert "MoE: expert weights not LoRA-adapted" in survey.render(results, ["mixtral"])


def test_an_output_that_does_not_reload_is_not_counted_as_passing() -> None:
    results = {
        "llama": {
            "build": {"status": "ok", "moe": False},
            "lora": {"status": "ok", "lora_modules": 14, "reload": "KeyError: 'lm_head'"},
            "packing": {"status": "ok", "lora_modules": 14},
            "full": {"status": "ok"},
        }
    }
    doc = survey.render(results, ["llama"])
    assert (
        "| llama | ok, reload fails | ok (14 modules) | ok | lora output does not reload: `KeyError: 'lm_head'` |"
        in doc
    )
    assert "all three modes pass for 0." in doc


def test_a_config_without_a_pad_token_id_attribute_gets_the_tokenizers(tmp_path):
    """CodeGen's config class has no `pad_token_id` attribute at all (not None): loading sets the tokenizer's."""
    from transformers import CodeGenConfig, CodeGenForCausalLM

    from hellbender.config import validate_config
    from hellbender.models.loading import load_model, load_tokenizer_and_processor
    from hellbender.models.tiny import build_tiny_tokenizer
    from tests.helpers import base_config

    tokenizer = build_tiny_tokenizer()
    config = CodeGenConfig(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, rotary_dim=8, n_positions=64)
    assert not hasattr(config, "pad_token_id")
    CodeGenForCausalLM(config).save_pretrained(tmp_path / "codegen")
    tokenizer.save_pretrained(tmp_path / "codegen")
    cfg = validate_config(base_config(tmp_path, base_model=str(tmp_path / "codegen")))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    model = load_model(cfg, tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None


def test_every_architecture_the_survey_found_bidirectional_is_made_causal_or_refused() -> None:
    """The survey's causality probe (a later token must not change earlier logits) runs on every causal-LM type of
    the installed transformers; each one it found attending both ways must be in hellbender's encoder table."""
    from hellbender.models.fixes.encoders import CAUSAL_SWITCHES, REFUSED

    results = survey.load_results()
    found = sorted(t for t, e in results.items() if not t.startswith("_") and e.get("build", {}).get("bidirectional"))
    assert found, "the survey recorded no bidirectional architecture: check its probe"
    assert not [t for t in found if t not in CAUSAL_SWITCHES and t not in REFUSED]


def test_notes_name_the_causal_switch_the_eager_fallback_and_left_out_layers() -> None:
    results = {
        "bert": {"build": {"status": "ok", "bidirectional": True}, **{m: {"status": "ok"} for m in survey.MODES}},
        "gpt_neo": {"build": {"status": "ok", "attention": "eager"}, **{m: {"status": "ok"} for m in survey.MODES}},
        "mamba": {
            "build": {"status": "ok", "attention": "sdpa"},
            "lora": {"status": "ok", "lora_modules": 2, "left_out": "`lora_target_linear` leaves out 2 layer(s)"},
            "packing": {"status": "ok"},
            "full": {"status": "ok"},
        },
    }
    doc = survey.render(results, ["bert", "gpt_neo", "mamba"])
    assert "| bert | ok | ok | ok | attends both ways as built; hellbender sets `is_decoder: true`" in doc
    assert "| gpt_neo | ok (eager) | ok (eager) | ok (eager) | no SDPA path in transformers" in doc
    assert "| mamba | ok (2 modules) | ok | ok | `'lora_target_linear' leaves out 2 layer(s)` |" in doc


def test_the_image_text_to_text_section_counts_each_status_and_gives_the_reason() -> None:
    ok = {"status": "ok", "lora_modules": 14}
    refusal = {"status": "ConfigError: `<model dir>` is not supported yet", "refused": True}
    results = {
        survey.VLM_RESULTS_KEY: {
            "llava": {"build": {"status": "ok"}, "lora": ok, "full": {"status": "ok"}},
            "mllama": {"build": {"status": "ok"}, "lora": refusal, "full": refusal},
            "qwen2_vl": {"build": {"status": "ok"}, "lora": ok, "full": {"status": "ok", "reload": "KeyError: 'x'"}},
            "aria": {"build": {"status": survey.NOT_SURVEYED_PREFIX + "no offline tiny `AriaProcessor`"}},
        }
    }
    doc = survey.render(results, ["llama"], ["aria", "blip", "llava", "mllama", "qwen2_vl"])
    assert "5 architectures: 1 trains, 1 refused, 1 fails, 0 not built, 2 not surveyed." in doc
    assert "| llava | trains | ok (14 modules) | ok |  |" in doc
    assert "| mllama | refused | refused | refused | lora: `ConfigError: '<model dir>' is not supported yet` |" in doc
    assert "| qwen2_vl | fails | ok (14 modules) | ok, reload fails | full: `KeyError: 'x'` |" in doc
    assert "| aria | not surveyed | - | - | no offline tiny `AriaProcessor` |" in doc
    assert f"| blip | not surveyed | - | - | {survey.NOT_SURVEYED} |" in doc


def test_every_vision_family_hellbender_refuses_shows_the_refusal_with_its_reason() -> None:
    section = survey.load_results()[survey.VLM_RESULTS_KEY]
    refused = {t: r for t, r in survey.refused_vision_families().items() if t in survey.image_text_to_text_types()}
    assert refused, "hellbender refuses no family of the mapping: check `UNSUPPORTED_VISION_FAMILIES`"
    for model_type, reason in refused.items():
        assert survey.vlm_status(section.get(model_type)) == "refused", model_type
        assert reason in section[model_type]["lora"]["status"], model_type


def test_every_family_the_survey_builds_is_recorded_and_only_those_read_not_surveyed() -> None:
    """A family with a tiny builder in the survey has a recorded run; every other type of the mapping is recorded
    with the reason it is not surveyed (so a new transformers type or a new builder shows up here)."""
    section = survey.load_results()[survey.VLM_RESULTS_KEY]
    assert sorted(section) == survey.image_text_to_text_types(), "run `scripts/model_survey.py --vlm`"
    for model_type, entry in section.items():
        # an entry surveyed with torchvision keeps the reason it had there (CI has no torchvision)
        reason = survey.vlm_not_surveyed_reason(model_type, bool(survey.surveyed_with_torchvision(entry)))
        if reason is None:
            assert survey.vlm_status(entry) != "not surveyed", f"{model_type}: run `model_survey.py --vlm --redo`"
        else:
            assert entry["build"]["status"] == survey.NOT_SURVEYED_PREFIX + reason, model_type


def test_rows_surveyed_with_torchvision_are_named_with_their_versions_and_keep_their_reason() -> None:
    ok = {"status": "ok", "lora_modules": 14}
    results = {
        survey.VLM_RESULTS_KEY: {
            "mistral3": {"build": {"status": "ok"}, "lora": ok, "full": {"status": "ok"}, "torchvision": "0.29.1",
                         "torch": "2.14.1"},
            "llava": {"build": {"status": "ok"}, "lora": ok, "full": {"status": "ok"}},
        }
    }  # fmt: skip
    doc = survey.render(results, ["llama"], ["llava", "mistral3"])
    assert "with torch 2.14.1 and torchvision 0.29.1 (1 row: mistral3)" in doc
    plain = {survey.VLM_RESULTS_KEY: {"llava": results[survey.VLM_RESULTS_KEY]["llava"]}}
    assert "second environment" not in survey.render(plain, ["llama"], ["llava"])
    # a builder that needs torchvision reads `not surveyed` without it, and is surveyed with it
    assert "torchvision" in survey.vlm_not_surveyed_reason("mistral3", torchvision=False)
    assert survey.vlm_not_surveyed_reason("mistral3", torchvision=True) is None
    assert survey.vlm_not_surveyed_reason("llava", torchvision=False) is None
