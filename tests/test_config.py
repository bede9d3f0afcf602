"""Config validation: unknown and not-yet-supported keys, types, conflicts, derived defaults, overrides, reference."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import dump_config, load_config, validate_config
from hellbender.config.overrides import apply_overrides
from hellbender.config.reference import config_markdown
from hellbender.errors import ConfigError, UserError
from tests.conftest import REPO, write_config

BASE = {
    "base_model": "hellbender/tiny-llama",
    "datasets": [{"path": "data/train.jsonl", "type": "alpaca"}],
}


def cfg_dict(**changes) -> dict:
    """A valid minimal config with `changes` applied (a value of `...` removes the key)."""
    raw = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def config_error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert isinstance(info.value, UserError) and info.value.exit_code == 2
    return str(info.value)


def test_minimal_config_is_valid():
    cfg = validate_config(cfg_dict())
    assert cfg.base_model == "hellbender/tiny-llama"
    assert cfg.datasets[0].path == "data/train.jsonl"
    assert cfg.datasets[0].type == "alpaca"


# ---------------------------------------------------------------- unknown and unsupported keys


def test_unknown_key_suggests_the_closest_key():
    message = config_error(cfg_dict(learning_rat=1e-4))
    assert "`learning_rat` is not a config key" in message
    assert "Did you mean `learning_rate`" in message


def test_unknown_key_without_a_close_match_points_at_the_reference():
    message = config_error(cfg_dict(zzzzqqqq=1))
    assert "`zzzzqqqq` is not a config key" in message
    assert "Did you mean" not in message
    assert "hellbender schema" in message


def test_an_unknown_key_inside_a_settings_block_suggests_the_closest_key_of_that_block():
    message = config_error(cfg_dict(qat={"weight_dtyp": "int4"}))
    assert "`qat.weight_dtyp`" in message and "Did you mean `qat.weight_dtype`?" in message
    message = config_error(cfg_dict(fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrp": "LlamaDecoderLayer"}))
    assert "Did you mean `fsdp_config.transformer_layer_cls_to_wrap`?" in message
    assert "Did you mean" not in config_error(cfg_dict(qat={"zzzzqqqq": 1}))


def test_every_unknown_key_is_reported_at_once():
    message = config_error(cfg_dict(learning_rat=1e-4, micro_batch_sise=2))
    assert "Did you mean `learning_rate`" in message
    assert "Did you mean `micro_batch_size`" in message


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("neftune_noise_alpha", 5, " is not supported yet: hellbender does not implement it"),
        (
            "process_reward_model",
            True,
            " is not supported yet: it belongs to more preference tuning (process reward models",
        ),
        ("lisa_step_interval", 20, ": LISA (training a random subset of layers at a time) is not offered"),
        (
            "relora",
            True,
            ": ReLoRA (merging the adapter into the base and restarting it during training) is not offered",
        ),
    ],
)
def test_axolotl_key_not_implemented_is_refused_by_name_with_why(key, value, why):
    message = config_error(cfg_dict(**{key: value}))
    assert f"`{key}`{why}" in message
    assert "is not a config key" not in message


def test_keys_refused_for_one_reason_share_one_paragraph():
    message = config_error(cfg_dict(lisa_n_layers=4, lisa_step_interval=20, relora=True))
    paragraphs = message.split("\n\n")
    assert len(paragraphs) == 2
    assert paragraphs[0].startswith("`lisa_n_layers`, `lisa_step_interval`: LISA")
    assert "Remove them (or set them to false / null)." in paragraphs[0]


def test_a_cloud_launcher_file_is_named_as_one_without_asking_for_a_model():
    message = config_error({"provider": "modal", "gpu": "h100", "gpu_count": 8, "secrets": ["HF_TOKEN"]})
    assert message.startswith("`provider`, `gpu`, `gpu_count`, `secrets`: read by Axolotl's cloud launcher")
    assert "run `hellbender train CONFIG` on the machine" in message
    assert "base_model" not in message
    # a training config with one launcher key still needs its model
    assert "`base_model` is required but missing" in config_error({"gpu": "h100", "datasets": []})


@pytest.mark.parametrize("key", ["use_dsv4_kernels", "expert_parallel_token_capacity", "nvfp4_merge_aware"])
def test_moe_kernel_and_expert_parallel_keys_are_planned(key):
    assert f"`{key}` is not supported yet: it belongs to mixture-of-experts training" in config_error(
        cfg_dict(**{key: True})
    )


def test_process_reward_data_is_refused_as_planned():
    raw = cfg_dict(datasets=[{"path": "a.jsonl", "type": "stepwise_supervised", "step_separator": "\n"}])
    message = config_error(raw)
    assert "`stepwise_supervised` is process-reward data" in message
    assert (
        "In `datasets[0]`: `step_separator` is not supported yet: it belongs to more preference tuning (process reward models"
        in message
    )


def test_skip_prepare_dataset_on_conversations_is_read_as_preparing_them(caplog):
    raw = cfg_dict(skip_prepare_dataset=True, datasets=[{"path": "a.jsonl", "type": "chat_template"}])
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        cfg = validate_config(raw)
    assert cfg.skip_prepare_dataset is False
    assert "`skip_prepare_dataset: true` asks Axolotl to tokenize conversations batch by batch" in caplog.text
    # on other rows it keeps its meaning (already-tokenized multimodal rows) and its checks
    message = config_error(cfg_dict(skip_prepare_dataset=True, datasets=[{"path": "a.jsonl", "type": "alpaca"}]))
    assert "skip_prepare_dataset" in message


def test_a_key_that_describes_what_hellbender_does_is_accepted_only_with_that_value():
    assert validate_config(cfg_dict(save_safetensors=True)).model_dump() == validate_config(cfg_dict()).model_dump()
    assert "`save_safetensors: false` cannot be honoured: transformers 5 always writes safetensors" in config_error(
        cfg_dict(save_safetensors=False)
    )


def test_keys_that_steer_only_axolotls_own_tooling_change_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        cfg = validate_config(cfg_dict(gradio_server_port=7860, use_otel_metrics=True, strict=False))
    assert "`gradio_server_port` steers Axolotl's Gradio chat UI; it changes nothing here." in caplog.text
    assert validate_config(cfg_dict()).model_dump() == cfg.model_dump()


@pytest.mark.parametrize("value", [False, None, "", [], {}])
@pytest.mark.parametrize("key", ["neftune_noise_alpha", "lora_model_dir", "relora"])
def test_axolotl_key_not_implemented_but_unset_is_accepted(key, value):
    cfg = validate_config(cfg_dict(**{key: value}))
    assert key not in cfg.model_dump()


def test_unknown_key_inside_a_dataset_entry_names_the_entry():
    raw = cfg_dict(datasets=[{"path": "a.jsonl", "type": "alpaca"}, {"path": "b.jsonl", "typ": "alpaca"}])
    message = config_error(raw)
    assert "`datasets[1]`" in message
    assert "`typ` is not a config key" in message
    assert "Did you mean `type`" in message

    message = config_error(cfg_dict(datasets=[{"path": "a.jsonl", "type": "alpaca", "feild": "x"}]))
    assert "`datasets[0]`" in message
    assert "`feild`" in message


def test_unknown_key_inside_test_datasets_and_pretraining_dataset_names_the_entry():
    message = config_error(cfg_dict(test_datasets=[{"path": "t.jsonl", "type": "alpaca", "bogus_key": 1}]))
    assert "`test_datasets[0]`" in message and "`bogus_key`" in message
    raw = cfg_dict(datasets=..., max_steps=5, pretraining_dataset=[{"path": "p.jsonl", "text_colum": "body"}])
    message = config_error(raw)
    assert "`pretraining_dataset[0]`" in message and "Did you mean `text_column`" in message


def test_axolotl_dataset_key_not_implemented_is_refused_in_the_entry():
    message = config_error(cfg_dict(datasets=[{"path": "a.jsonl", "type": "alpaca", "shards": 4}]))
    assert "`datasets[0]`" in message
    assert "`shards` is not supported yet" in message
    cfg = validate_config(cfg_dict(datasets=[{"path": "a.jsonl", "type": "alpaca", "shards": None}]))
    assert cfg.datasets[0].path == "a.jsonl"


# ---------------------------------------------------------------- types and ranges


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"micro_batch_size": "abc"}, "`micro_batch_size`"),
        ({"adapter": "lora", "lora_r": -1}, "`lora_r`"),
        ({"sequence_len": 1}, "`sequence_len`"),
        ({"learning_rate": 0}, "`learning_rate`"),
        ({"num_epochs": "many"}, "`num_epochs`"),
        ({"adapter": "lorax"}, "`adapter`"),
        ({"lr_scheduler": "cosin"}, "`lr_scheduler`"),
        ({"datasets": [{"path": "a.jsonl", "type": "alpacca"}]}, "`datasets.0.type`"),
        ({"datasets": [{"type": "alpaca"}]}, "`datasets.0.path`"),
    ],
)
def test_wrong_type_or_range_names_the_key(changes, needle):
    message = config_error(cfg_dict(**changes))
    assert needle in message


def test_wrong_type_shows_the_bad_value():
    message = config_error(cfg_dict(micro_batch_size="abc"))
    assert "'abc'" in message


def test_base_model_is_required():
    message = config_error(cfg_dict(base_model=...))
    assert "`base_model` is required" in message


# ---------------------------------------------------------------- conflicts (checks.py)

STREAM = [{"path": "corpus.jsonl"}]
CONFLICTS = [
    pytest.param({"bf16": True, "fp16": True}, "`bf16: true` and `fp16: true` are both set", id="bf16+fp16"),
    pytest.param({"datasets": ..., "pretraining_dataset": STREAM}, "`max_steps` is missing", id="stream-no-max-steps"),
    pytest.param(
        {"datasets": ..., "pretraining_dataset": STREAM, "max_steps": 5, "val_set_size": 0.1},
        "`val_set_size` cannot split a streamed `pretraining_dataset`",
        id="stream-val-set-size",
    ),
    pytest.param({"streaming": True}, "a `datasets:` stream (`streaming: true`) has no known length", id="stream-sft"),
    pytest.param(
        {"streaming": True, "max_steps": 5, "val_set_size": 0.1},
        "`val_set_size` cannot split a `datasets:` stream",
        id="stream-sft-val-set-size",
    ),
    pytest.param(
        {"streaming": True, "max_steps": 5, "processor_type": "AutoProcessor"},
        "image+text chat rows of a vision-language model are not streamed yet",
        id="stream-sft-vlm",
    ),
    pytest.param({"streaming_multipack_buffer_size": 64}, "but nothing is streamed here", id="buffer-without-stream"),
    pytest.param(
        {"streaming": True, "max_steps": 5, "shuffle_merged_datasets": False, "streaming_multipack_buffer_size": 64},
        "would do nothing: the stream is not shuffled",
        id="buffer-unused",
    ),
    pytest.param(
        {"streaming": True, "max_steps": 5, "pretrain_multipack_attn": False},
        "`pretrain_multipack_attn: false` lets the documents packed",
        id="multipack-attn-sft",
    ),
    pytest.param(
        {"save_steps": 10, "saves_per_epoch": 2}, "`save_steps` and `saves_per_epoch` are both set", id="saves"
    ),
    pytest.param(
        {"val_set_size": 0.1, "eval_steps": 10, "evals_per_epoch": 2},
        "`eval_steps` and `evals_per_epoch` are both set",
        id="evals",
    ),
    pytest.param(
        {"warmup_steps": 10, "warmup_ratio": 0.1}, "`warmup_steps` and `warmup_ratio` are both set", id="warmup"
    ),
    pytest.param({"lora_r": 16}, "`lora_r` set but `adapter` is not", id="lora-r-no-adapter"),
    pytest.param({"peft_use_dora": True}, "`peft_use_dora` set but `adapter` is not", id="dora-no-adapter"),
    pytest.param({"load_in_4bit": True}, "`load_in_4bit: true` needs `adapter: qlora`", id="4bit-full"),
    pytest.param(
        {"load_in_4bit": True, "adapter": "lora"}, "`load_in_4bit: true` needs `adapter: qlora`", id="4bit-lora"
    ),
    pytest.param(
        {"flash_attention": True, "attn_implementation": "eager"},
        "`flash_attention: true` contradicts `attn_implementation: eager`",
        id="flash-vs-eager",
    ),
    pytest.param(
        {"sdp_attention": True, "attn_implementation": "eager"},
        "`sdp_attention: true` contradicts `attn_implementation: eager`",
        id="sdp-vs-eager",
    ),
    pytest.param(
        {"flash_attention": True, "sdp_attention": True},
        "`flash_attention` and `sdp_attention` are both true",
        id="flash+sdp",
    ),
    pytest.param(
        {"flex_attn_compile_kwargs": {"dynamic": False}},
        "`flex_attn_compile_kwargs` sets how flex attention is compiled, but `attn_implementation` is not "
        "`flex_attention`",
        id="flex-kwargs-without-flex",
    ),
    pytest.param(
        {
            "attn_implementation": "flex_attention",
            "flex_attn_compile_kwargs": {"dynamic": False},
            "torch_compile": True,
        },
        "`flex_attn_compile_kwargs` cannot be honoured with `torch_compile: true`",
        id="flex-kwargs-in-compiled-model",
    ),
    pytest.param(
        {"attn_implementation": "flex_attention", "flex_attn_compile_kwargs": {"mode": "fastest"}},
        "`flex_attn_compile_kwargs`: `mode` must be one of `default`, `reduce-overhead`, `max-autotune`, "
        "`max-autotune-no-cudagraphs`",
        id="flex-kwargs-mode",
    ),
    pytest.param(
        {"attn_implementation": "flex_attention", "flex_attn_compile_kwargs": {"dynamc": False}},
        "`flex_attn_compile_kwargs`: `dynamc` is not a keyword argument of torch.compile",
        id="flex-kwargs-unknown",
    ),
    pytest.param(
        {"attn_implementation": "flex_attention", "flex_attn_compile_kwargs": {"disable": True}},
        "`flex_attn_compile_kwargs`: `disable` is not accepted: uncompiled flex attention",
        id="flex-kwargs-disable",
    ),
    pytest.param(
        {"chat_template": "llama_3"},
        "`chat_template: llama_3` is not a chat template hellbender knows (did you mean `llama3`?). Known names: "
        "`tokenizer_default`, `jinja`, `chatml`",
        id="chat-template-name",
    ),
    pytest.param(
        {"datasets": [{"path": "c.jsonl", "type": "chat_template", "chat_template": "vicuna"}]},
        "Dataset `c.jsonl`: `chat_template: vicuna` is not a chat template hellbender knows. Known names:",
        id="dataset-chat-template-name",
    ),
    pytest.param(
        {"chat_template": "jinja"},
        "`chat_template: jinja` needs the template itself in `chat_template_jinja`",
        id="jinja",
    ),
    pytest.param(
        {"datasets": [{"path": "c.jsonl", "type": "chat_template", "chat_template": "jinja"}]},
        "Dataset `c.jsonl`: `chat_template: jinja` needs `chat_template_jinja`",
        id="dataset-jinja",
    ),
    pytest.param({"datasets": ...}, "No training data", id="no-datasets"),
    pytest.param({"datasets": []}, "No training data", id="empty-datasets"),
]


@pytest.mark.parametrize(("changes", "needle"), CONFLICTS)
def test_conflict_gives_its_message(changes, needle):
    assert needle in config_error(cfg_dict(**changes))


def test_conflicts_are_reported_together():
    message = config_error(cfg_dict(bf16=True, fp16=True, warmup_steps=1, warmup_ratio=0.1))
    assert "`bf16: true` and `fp16: true`" in message
    assert "`warmup_steps` and `warmup_ratio`" in message


@pytest.mark.parametrize(
    "changes",
    [
        {"bf16": True},
        {"fp16": True, "bf16": False},
        {"datasets": ..., "pretraining_dataset": STREAM, "max_steps": 5, "save_steps": 2},
        {"save_steps": 10},
        {"val_set_size": 0.1, "eval_steps": 10},
        {"test_datasets": [{"path": "t.jsonl", "type": "alpaca"}], "evals_per_epoch": 2},
        {"adapter": "lora", "lora_r": 16, "peft_use_dora": True},
        {"adapter": "qlora", "load_in_4bit": True},
        {"flash_attention": True, "attn_implementation": "flash_attention_2"},
        {"sample_packing": True, "attn_implementation": "eager"},
        {"sample_packing": True, "attn_implementation": "flex_attention"},
        {
            "sample_packing": True,
            "attn_implementation": "flex_attention",
            "flex_attn_compile_kwargs": {"dynamic": False, "mode": "max-autotune-no-cudagraphs"},
        },
        {"chat_template": "chatml"},
        {"chat_template": "jinja", "chat_template_jinja": "{{ messages }}"},
    ],
)
def test_compatible_keys_pass(changes):
    validate_config(cfg_dict(**changes))


# ---------------------------------------------------------------- derived defaults


def test_learning_rate_default_depends_on_adapter():
    assert validate_config(cfg_dict()).learning_rate == 2e-5
    assert validate_config(cfg_dict(adapter="lora")).learning_rate == 2e-4
    assert validate_config(cfg_dict(adapter="qlora")).learning_rate == 2e-4
    assert validate_config(cfg_dict(adapter="lora", learning_rate=3e-3)).learning_rate == 3e-3
    assert validate_config(cfg_dict(learning_rate="1e-4")).learning_rate == 1e-4


def test_attn_implementation_default():
    assert validate_config(cfg_dict()).attn_implementation == "sdpa"
    assert validate_config(cfg_dict(flash_attention=True)).attn_implementation == "flash_attention_2"
    assert validate_config(cfg_dict(sdp_attention=True)).attn_implementation == "sdpa"
    assert validate_config(cfg_dict(attn_implementation="eager")).attn_implementation == "eager"


def test_qlora_sets_load_in_4bit():
    assert validate_config(cfg_dict(adapter="qlora")).load_in_4bit is True
    assert validate_config(cfg_dict(adapter="lora")).load_in_4bit is False
    assert validate_config(cfg_dict()).load_in_4bit is False


def test_dataset_prepared_path_default_is_beside_output_dir(tmp_path):
    out = tmp_path / "runs" / "exp1"
    cfg = validate_config(cfg_dict(output_dir=str(out)))
    assert Path(cfg.dataset_prepared_path) == tmp_path / "runs" / "last_run_prepared"
    cfg = validate_config(cfg_dict(output_dir=str(out), dataset_prepared_path=str(tmp_path / "prep")))
    assert cfg.dataset_prepared_path == str(tmp_path / "prep")


def test_streaming_defaults_to_true_for_pretraining_dataset():
    cfg = validate_config(cfg_dict(datasets=..., pretraining_dataset=STREAM, max_steps=3))
    assert cfg.streaming is True and cfg.uses_streaming
    assert cfg.pretraining_dataset[0].path == "corpus.jsonl"
    assert cfg.pretraining_dataset[0].text_column == "text"
    cfg = validate_config(cfg_dict())
    assert cfg.streaming is False and not cfg.uses_streaming  # decided, so `validate` shows it


def test_pretraining_dataset_may_be_a_single_mapping():
    cfg = validate_config(cfg_dict(datasets=..., pretraining_dataset={"path": "corpus.jsonl"}, max_steps=3))
    assert [e.path for e in cfg.pretraining_dataset] == ["corpus.jsonl"]


def test_other_derived_defaults():
    cfg = validate_config(cfg_dict(micro_batch_size=3))
    assert cfg.eval_batch_size == 3
    assert cfg.chat_template == "tokenizer_default"


# ---------------------------------------------------------------- --set overrides


def test_override_scalar():
    raw = apply_overrides(cfg_dict(), ["learning_rate=1e-4", "micro_batch_size=4", "sample_packing=true"])
    cfg = validate_config(raw)
    assert cfg.learning_rate == 1e-4
    assert cfg.micro_batch_size == 4
    assert cfg.sample_packing is True


def test_override_dotted_list_index_and_new_mapping():
    raw = cfg_dict(datasets=[{"path": "a.jsonl", "type": "alpaca"}, {"path": "b.jsonl", "type": "alpaca"}])
    raw = apply_overrides(
        raw, ["datasets.1.path=other.jsonl", "datasets.0.type=completion", "special_tokens.pad_token=<p>"]
    )
    cfg = validate_config(raw)
    assert [(d.path, d.type) for d in cfg.datasets] == [("a.jsonl", "completion"), ("other.jsonl", "alpaca")]
    assert cfg.special_tokens == {"pad_token": "<p>"}


def test_override_empty_value_is_null():
    cfg = validate_config(apply_overrides(cfg_dict(adapter="lora"), ["adapter="]))
    assert cfg.adapter is None


@pytest.mark.parametrize("item", ["foo", "=1"])
def test_override_without_key_value_form_is_config_error(item):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides(cfg_dict(), [item])


def test_override_list_index_out_of_range_is_config_error():
    with pytest.raises(ConfigError, match="not an index of a list with 1 entries"):
        apply_overrides(cfg_dict(), ["datasets.3.path=x.jsonl"])
    with pytest.raises(ConfigError, match="not an index"):
        apply_overrides(cfg_dict(), ["datasets.first.path=x.jsonl"])


def test_override_into_a_scalar_is_config_error():
    with pytest.raises(ConfigError, match="`base_model` is not a mapping or list"):
        apply_overrides(cfg_dict(), ["base_model.revision=main"])


def test_override_value_that_is_not_valid_yaml_is_config_error():
    # A typo in `--set` is the user's to fix: it must be a ConfigError naming the override, not a YAML traceback.
    with pytest.raises(ConfigError, match="micro_batch_size"):
        apply_overrides(cfg_dict(), ["micro_batch_size=[1,"])


def test_load_config_applies_overrides_after_reading(tmp_path):
    path = write_config(tmp_path / "c.yml", yaml.safe_dump(cfg_dict(learning_rate=0.1)))
    cfg = load_config(path, ["learning_rate=0.5", "datasets.0.path=z.jsonl"])
    assert cfg.learning_rate == 0.5
    assert cfg.datasets[0].path == "z.jsonl"
    with pytest.raises(ConfigError, match="Did you mean `learning_rate`"):
        load_config(path, ["learning_rat=0.5"])


# ---------------------------------------------------------------- reading YAML


def test_yaml_syntax_error_names_the_line(tmp_path):
    text = "base_model: hellbender/tiny-llama\nlearning_rate: 1\n  micro_batch_size: 2\n"
    path = write_config(tmp_path / "broken.yml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "line 3" in str(info.value)
    assert "broken.yml" in str(info.value)


def test_merge_keys_are_read_and_a_replaced_merged_value_is_said(tmp_path, caplog):
    merged = {**BASE, "learning_rate": 0.1}
    path = write_config(tmp_path / "merged.yml", f"<<: {json.dumps(merged)}\nlearning_rate: 0.5\n")
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        cfg = load_config(path)
    assert cfg.learning_rate == 0.5 and cfg.base_model == BASE["base_model"]
    assert (
        "`learning_rate: 0.5` on line 2 replaces `learning_rate: 0.1`, merged in with `<<:` from line 1" in caplog.text
    )


def test_yaml_that_is_not_a_mapping_is_config_error(tmp_path):
    path = write_config(tmp_path / "list.yml", "- base_model: x\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(path)


def test_missing_config_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yml")


def test_empty_config_file_reports_what_is_missing(tmp_path):
    path = write_config(tmp_path / "empty.yml", "")
    with pytest.raises(ConfigError, match="`base_model` is required"):
        load_config(path)


# ---------------------------------------------------------------- dump_config round trip

ROUND_TRIP = [
    pytest.param({"adapter": "lora", "lora_r": 4, "lora_target_linear": True}, id="lora"),
    pytest.param({"adapter": "qlora", "sample_packing": True, "flash_attention": True}, id="qlora"),
    pytest.param({}, id="full-finetune"),
    pytest.param({"datasets": ..., "pretraining_dataset": STREAM, "max_steps": 7, "adapter": "lora"}, id="streaming"),
    pytest.param(
        {
            "adapter": "lora",
            "datasets": [
                {"path": "c.jsonl", "type": "chat_template", "roles": {"user": ["human"]}, "train_on_eos": "all"}
            ],
            "test_datasets": [{"path": "t.jsonl", "type": "chat_template"}],
            "chat_template": "chatml",
            "evals_per_epoch": 2,
            "warmup_ratio": 0.1,
            "report_to": ["tensorboard"],
        },
        id="chat-with-eval",
    ),
]


@pytest.mark.parametrize("changes", ROUND_TRIP)
def test_dump_config_round_trips(changes):
    cfg = validate_config(cfg_dict(**changes))
    again = validate_config(yaml.safe_load(dump_config(cfg)))
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()


def test_dump_config_has_every_key():
    cfg = validate_config(cfg_dict())
    dumped = yaml.safe_load(dump_config(cfg))
    assert set(dumped) == set(type(cfg).model_fields)
    assert dumped["learning_rate"] == 2e-5


# ---------------------------------------------------------------- reference docs and schema


def test_docs_config_md_is_current():
    doc = REPO / "docs" / "config.md"
    assert doc.is_file(), "docs/config.md is missing: run `hellbender schema --markdown > docs/config.md`"
    assert doc.read_text() == config_markdown(), (
        "docs/config.md is stale: run `hellbender schema --markdown > docs/config.md`"
    )


def test_config_markdown_lists_every_key():
    markdown = config_markdown()
    for key in ("base_model", "learning_rate", "lora_r", "datasets", "chat_template_jinja", "text_column"):
        assert f"| `{key}` |" in markdown


def test_schema_command_prints_json_schema():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert "base_model" in schema["properties"]
    assert "base_model" in schema.get("required", [])


def test_schema_markdown_command_prints_the_reference():
    result = CliRunner().invoke(app, ["schema", "--markdown"])
    assert result.exit_code == 0, result.output
    assert result.stdout == config_markdown()


# ---------------------------------------------------------------- values checked against the libraries


def _models_under(model: type, seen: set[type]) -> None:
    """Every settings model reachable from `model` through its fields (nested mappings such as `fsdp_config`)."""
    from pydantic import BaseModel

    if model in seen:
        return
    seen.add(model)
    for info in model.model_fields.values():
        for leaf in _leaves(info.annotation):
            if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                _models_under(leaf, seen)


def _leaves(annotation) -> list:
    import typing

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _leaves(args[0])
    return [leaf for arg in args for leaf in _leaves(arg)] if args else [annotation]


def _bare_numbers(annotation, metadata=()) -> list:
    """int / float types in `annotation` not wrapped in the shared `Int` / `Float` (which refuse booleans)."""
    import typing

    from hellbender.config.values import Float, Int

    shared = {id(m) for t in (Int, Float) for m in typing.get_args(t)[1:]}
    if typing.get_origin(annotation) is typing.Annotated:
        return _bare_numbers(typing.get_args(annotation)[0], typing.get_args(annotation)[1:])
    if annotation in (int, float):
        return [] if any(id(m) in shared for m in metadata) else [annotation]
    return [bare for arg in typing.get_args(annotation) for bare in _bare_numbers(arg)]


def test_every_number_key_of_every_settings_model_uses_the_shared_number_types():
    """A new `int` / `float` key must refuse `true` (pydantic's lax mode reads it as 1) and `.nan` / `.inf` like the
    others: it is declared with `Int` / `Float` from `hellbender.config.values`."""
    from hellbender.config import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry

    models: set[type] = set()
    for model in (HellbenderConfig, DatasetEntry, PretrainingDatasetEntry):
        _models_under(model, models)
    assert len(models) > 5  # nested settings (fsdp_config, peft, accelerator_config, ...) are walked too
    bare = [
        f"{model.__name__}.{name}"
        for model in models
        for name, info in model.model_fields.items()
        if _bare_numbers(info.annotation, info.metadata)
    ]
    assert bare == []


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("micro_batch_size", True, "must be an integer, not true"),
        ("learning_rate", False, "must be a number, not false"),
        ("num_epochs", float("inf"), "finite number"),
        ("weight_decay", float("nan"), "finite number"),
        ("seed", 2**32, "less than or equal to 4294967295"),
        ("output_dir", "", "is an empty path"),
        ("output_dir", "out\0put", "NUL byte"),
        ("optimizer", "adamw_torch_fusd", "did you mean `adamw_torch_fused`?"),
        ("lr_scheduler", "cosine_with_min_lr", "transformers' `cosine_with_min_lr` schedule is not offered"),
    ],
)
def test_values_the_libraries_refuse_are_refused_at_validation(key, value, words):
    message = config_error(cfg_dict(**{key: value}))
    assert f"`{key}`" in message and words in message, message


@pytest.mark.parametrize("value", [1, 4.0, "2e-5", "8"])
def test_numbers_as_yaml_gives_them_still_validate(value):
    """Integers for number keys and numeric text (YAML 1.1 reads `2e-5` as text) stay accepted; only booleans go."""
    cfg = validate_config(cfg_dict(learning_rate=value, micro_batch_size=value if value != "2e-5" else 1))
    assert cfg.learning_rate == float(value) and isinstance(cfg.micro_batch_size, int)


def test_optimizer_and_scheduler_names_follow_the_installed_transformers():
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    from hellbender.config.optimizer_names import (
        REFUSED_OPTIMIZERS,
        optimizer_problem,
        transformers_optimizers,
        transformers_schedulers,
    )
    from hellbender.config.training import LrScheduler

    # read from the source without importing it: the same names as the imported enums
    assert transformers_optimizers() == tuple(n.value for n in OptimizerNames)
    assert transformers_schedulers() == tuple(n.value for n in SchedulerType)
    assert set(typing_args(LrScheduler)) <= set(transformers_schedulers())
    assert set(REFUSED_OPTIMIZERS) <= set(transformers_optimizers())  # a refusal never outlives its name
    offered = [n for n in transformers_optimizers() if n not in REFUSED_OPTIMIZERS]
    assert "adamw_bnb_8bit" in offered and all(optimizer_problem(n) is None for n in offered)


def typing_args(literal) -> tuple:
    import typing

    return typing.get_args(literal)
