"""Axolotl's keys that ask for what hellbender already does are accepted and mean the same; older Axolotl spellings
are read as today's key with one notice line; settings that ask for nothing in this config are one notice line."""

from __future__ import annotations

import logging

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from tests.helpers import base_config


def same_config(tmp_path, axolotl: dict, hellbender: dict, ignore: tuple[str, ...] = ()) -> None:
    """The Axolotl spelling validates to the same config as hellbender's, so the run is the same run."""
    a = validate_config(base_config(tmp_path, **axolotl)).model_dump()
    b = validate_config(base_config(tmp_path, **hellbender)).model_dump()
    for key in ignore:
        a.pop(key), b.pop(key)
    assert a == b


def test_non_reentrant_checkpointing_kwargs_are_what_hellbender_does(tmp_path):
    same_config(
        tmp_path,
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
        {"gradient_checkpointing": True},
        ignore=("gradient_checkpointing_kwargs",),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_reentrant": True}, "`gradient_checkpointing_kwargs.use_reentrant` must be false"),
        ({"use_reentrant": False, "preserve_rng_state": False}, "`preserve_rng_state` cannot be passed on"),
    ],
)
def test_checkpointing_kwargs_hellbender_cannot_honour_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs))


def test_the_older_dataset_processes_is_read_as_dataset_num_proc(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        same_config(tmp_path, {"dataset_processes": 3}, {"dataset_num_proc": 3})
    assert (
        "`dataset_processes` is an older spelling of `dataset_num_proc`; read as `dataset_num_proc: 3`." in caplog.text
    )


def test_two_spellings_of_one_key_with_different_values_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`dataset_processes: 2` and `dataset_num_proc: 4` are the same key"):
        validate_config(base_config(tmp_path, dataset_processes=2, dataset_num_proc=4))


def test_older_message_field_keys_become_message_property_mappings(tmp_path, caplog):
    older = [
        {"path": "chat.jsonl", "type": "chat_template", "message_field_role": "from", "message_field_content": "value"}
    ]
    today = [
        {
            "path": "chat.jsonl",
            "type": "chat_template",
            "message_property_mappings": {"role": "from", "content": "value"},
        }
    ]
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        same_config(tmp_path, {"datasets": older}, {"datasets": today})
    assert "read as `message_property_mappings.role: from`" in caplog.text


def test_an_evaluation_schedule_without_evaluation_data_is_a_notice(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        cfg = validate_config(base_config(tmp_path, eval_steps=10))
    assert not cfg.has_eval_data
    assert "`eval_steps` / `evals_per_epoch` is set but there is no evaluation data" in caplog.text
    assert "nothing is evaluated" in caplog.text


LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"


def test_liger_plugin_with_liger_keys_is_hellbenders_liger(tmp_path):
    same_config(
        tmp_path,
        {"plugins": [LIGER_PLUGIN], "liger_rms_norm": True, "liger_glu_activation": True},
        {"liger_rms_norm": True, "liger_glu_activation": True},
        ignore=("plugins",),
    )


@pytest.mark.parametrize(
    "axolotl",
    [{"plugins": [CCE_PLUGIN]}, {"plugins": [CCE_PLUGIN], "cut_cross_entropy": True}, {"cut_cross_entropy": True}],
)
def test_cut_cross_entropy_is_the_fused_linear_cross_entropy(tmp_path, axolotl):
    cfg = validate_config(base_config(tmp_path, **axolotl))
    assert cfg.cut_cross_entropy is True and cfg.liger_fused_linear_cross_entropy is True and cfg.fuses_the_loss
    same_config(tmp_path, axolotl, {"liger_fused_linear_cross_entropy": True}, ignore=("plugins", "cut_cross_entropy"))


def test_cut_cross_entropy_turned_off_keeps_the_plain_loss(tmp_path):
    cfg = validate_config(base_config(tmp_path, plugins=[CCE_PLUGIN], cut_cross_entropy=False))
    assert not cfg.fuses_the_loss


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        ("axolotl.integrations.swanlab.SwanLabPlugin", "SwanLab logging is not offered; use `report_to: tensorboard`"),
        ("axolotl.integrations.kernels.KernelsPlugin", "kernels from the Hugging Face kernels hub are not offered"),
        ("my_company.plugins.Custom", "hellbender has no plugins; it does natively what"),
    ],
)
def test_other_plugins_are_refused_naming_what_hellbender_offers(tmp_path, plugin, message):
    with pytest.raises(ConfigError, match=rf"`plugins`: `{plugin}` is not supported: {message}"):
        validate_config(base_config(tmp_path, plugins=[LIGER_PLUGIN, plugin]))


def test_a_wandb_project_turns_on_wandb_reporting(tmp_path):
    cfg = validate_config(base_config(tmp_path, wandb_project="my-project", report_to="tensorboard"))
    assert cfg.report_targets == ["tensorboard", "wandb"]
    same_config(
        tmp_path,
        {"wandb_project": "my-project", "report_to": "tensorboard"},
        {"report_to": ["tensorboard", "wandb"]},
        ignore=("wandb_project",),
    )


def test_wandb_keys_reach_wandb_through_its_environment_variables(tmp_path):
    from hellbender.train.arguments import tracker_environment

    cfg = validate_config(
        base_config(
            tmp_path,
            wandb_project="p",
            wandb_entity="team",
            wandb_run_id="abc123",
            wandb_mode="offline",
            wandb_log_model=False,
            wandb_watch="gradients",
            wandb_name="first-try",
        )
    )
    assert tracker_environment(cfg) == {
        "WANDB_PROJECT": "p",
        "WANDB_ENTITY": "team",
        "WANDB_RUN_ID": "abc123",
        "WANDB_MODE": "offline",
        "WANDB_LOG_MODEL": "false",
        "WANDB_WATCH": "gradients",
    }


def test_a_wandb_project_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    from hellbender.errors import EnvironmentProblem
    from hellbender.train.arguments import report_targets

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = validate_config(base_config(tmp_path, wandb_project="p"))
    with pytest.raises(EnvironmentProblem, match=r"`wandb_project` is set, but the `wandb` package is not installed"):
        report_targets(cfg)


AXOLOTL_FSDP1 = {
    "fsdp": ["full_shard", "auto_wrap"],
    "fsdp_config": {
        "fsdp_limit_all_gathers": True,
        "fsdp_sync_module_states": True,
        "fsdp_offload_params": False,
        "fsdp_use_orig_params": False,  # FSDP1 flattened the parameters; FSDP2 never does
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
    },
}
FSDP2_SPELLING = {
    "fsdp_version": 2,
    "fsdp_config": {
        "offload_params": False,
        "cpu_ram_efficient_loading": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "state_dict_type": "FULL_STATE_DICT",
        "reshard_after_forward": True,
    },
}


def test_an_fsdp1_config_is_translated_to_the_fsdp2_settings_it_means(tmp_path, caplog):
    lora = {"adapter": "lora", "lora_target_linear": True}
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        same_config(tmp_path, {**AXOLOTL_FSDP1, **lora}, {**FSDP2_SPELLING, **lora})
    assert (
        "FSDP1 settings translated to FSDP2: `fsdp_version: 2`, reshard_after_forward: true, auto_wrap_policy: "
        "TRANSFORMER_BASED_WRAP; `backward_prefetch`, `limit_all_gathers`, `use_orig_params`, `sync_module_states` "
        "dropped (FSDP2 does that itself)."
    ) in caplog.text


def test_shard_grad_op_keeps_the_gathered_weights_after_forward(tmp_path):
    cfg = validate_config(base_config(tmp_path, fsdp="shard_grad_op auto_wrap offload"))
    assert cfg.fsdp_version == 2 and cfg.fsdp is None
    assert cfg.fsdp_settings.reshard_after_forward is False and cfg.fsdp_settings.offload_params is True


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"fsdp": ["hybrid_shard"]}, "`hybrid_shard` cannot be translated to FSDP2: .* set `dp_shard_size`"),
        ({"fsdp": ["full_shard"], "fsdp_config": {"forward_prefetch": True}}, "`fsdp_config.forward_prefetch: true`"),
        ({"fsdp_version": 1, "fsdp": ["full_shard"]}, "`fsdp_version: 1` is not supported"),
    ],
)
def test_fsdp1_settings_without_an_fsdp2_counterpart_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_a_streamed_run_counts_as_one_epoch_for_per_epoch_intervals(tmp_path):
    from hellbender.train.schedule import plan_schedule

    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a"}\n')
    cfg = validate_config(
        base_config(tmp_path, datasets=[], pretraining_dataset=[{"path": str(text)}], max_steps=100, saves_per_epoch=4)
    )
    assert plan_schedule(cfg, None).save_steps == 25


@pytest.mark.parametrize(
    "keys",
    [
        {"load_in_8bit": True},
        {"load_in_8bit": True, "adapter": "qlora"},
        {"load_in_8bit": True, "adapter": "lora", "load_in_4bit": True},
    ],
)
def test_load_in_8bit_needs_a_lora_adapter_on_an_unquantized_spelling(tmp_path, keys):
    with pytest.raises(ConfigError, match=r"`load_in_8bit: true` needs `adapter: lora`"):
        validate_config(base_config(tmp_path, **keys))


def test_load_in_8bit_without_a_gpu_is_a_clear_error(tmp_path):
    import torch

    from hellbender.errors import EnvironmentProblem
    from hellbender.models.loading import quantization_config

    cfg = validate_config(base_config(tmp_path, load_in_8bit=True, adapter="lora"))
    assert cfg.quantized_bits == 8
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; tests/test_gpu.py trains the 8-bit base there")
    with pytest.raises(
        EnvironmentProblem, match=r"`load_in_8bit: true` loads the base model in 8-bit with bitsandbytes"
    ):
        quantization_config(cfg)


def test_save_first_step_saves_a_checkpoint_after_the_first_step(tmp_path):
    from hellbender.storage import checkpoint_dirs
    from hellbender.train.run import train

    cfg = validate_config(base_config(tmp_path, max_steps=3, save_steps=3, save_first_step=True))
    train(cfg)
    assert [p.name for _, p in checkpoint_dirs(cfg.output_dir)] == ["checkpoint-1", "checkpoint-3"]


def test_unfrozen_parameters_train_only_what_they_match(tmp_path):
    from safetensors.torch import load_file

    from hellbender.models.tiny import tiny_model_dir
    from hellbender.train.run import train

    cfg = validate_config(
        base_config(tmp_path, max_steps=2, unfrozen_parameters=[r"^lm_head\.", r"model\.layers\.1\.mlp"])
    )
    train(cfg)
    before = load_file(tiny_model_dir("hellbender/tiny-llama") / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith(("lm_head.", "model.layers.1.mlp")) for name in changed), changed
    assert {"lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= changed


def test_unfrozen_parameters_that_match_nothing_or_go_with_an_adapter_are_refused(tmp_path):
    from hellbender.train.run import train

    with pytest.raises(ConfigError, match=r"`unfrozen_parameters` chooses what full fine-tuning trains"):
        validate_config(base_config(tmp_path, adapter="lora", unfrozen_parameters=["^lm_head"]))
    with pytest.raises(ConfigError, match=r"`unfrozen_parameters`: `\^transformer\.h` match no parameter"):
        train(validate_config(base_config(tmp_path, max_steps=1, unfrozen_parameters=["^transformer.h"])))


def test_new_tokens_with_lora_must_train_the_embeddings(tmp_path):
    from hellbender.train.run import train

    with pytest.raises(
        ConfigError,
        match=r"has 2 token\(s\) more than the model's embeddings.*`lora_modules_to_save: \[embed_tokens, lm_head\]`",
    ):
        train(validate_config(base_config(tmp_path, adapter="lora", max_steps=1, tokens=["<tool>", "</tool>"])))


def test_added_tokens_grow_the_embeddings_to_a_multiple_of_32(tmp_path):
    from transformers import AutoModelForCausalLM

    from hellbender.train.run import train

    cfg = validate_config(
        base_config(tmp_path, max_steps=1, tokens=["<tool>", "</tool>"], resize_token_embeddings_to_32x=True)
    )
    train(cfg)
    rows = AutoModelForCausalLM.from_pretrained(cfg.output_dir).get_input_embeddings().weight.shape[0]
    assert rows % 32 == 0


def test_activation_offloading_is_offloaded_checkpointing(tmp_path):
    same_config(
        tmp_path,
        {"gradient_checkpointing": True, "activation_offloading": True},
        {"gradient_checkpointing": "offload"},
    )
    with pytest.raises(ConfigError, match=r"`activation_offloading: disk` is not offered"):
        validate_config(base_config(tmp_path, gradient_checkpointing=True, activation_offloading="disk"))
    with pytest.raises(ConfigError, match=r"`gradient_checkpointing` is False: set it to true"):
        validate_config(base_config(tmp_path, gradient_checkpointing=False, activation_offloading=True))
