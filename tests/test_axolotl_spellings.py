"""Axolotl's keys that ask for what hellbender already does are accepted and mean the same; older Axolotl spellings
are read as today's key with one notice line; settings that ask for nothing in this config are one notice line."""

from __future__ import annotations

import logging
import math

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
        ({"use_reentrant": True}, "`gradient_checkpointing_kwargs.use_reentrant: true` is not offered"),
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
        ("axolotl.integrations.grokfast.GrokfastPlugin", "the Grokfast optimizer wrapper is not offered"),
        ("axolotl.integrations.kernels.KernelsPlugin", "its expert kernels belong to mixture-of-experts training"),
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


@pytest.mark.parametrize(
    "axolotl_spelling",
    [
        # `fsdp_version: 2` with FSDP1's sharding strategy left in `fsdp_config`, as many Axolotl configs have
        {"fsdp_version": 2, "fsdp_config": {**FSDP2_SPELLING["fsdp_config"], "sharding_strategy": "FULL_SHARD"}},
        # `fsdp_version` written inside `fsdp_config`, with the prefixed spellings
        {"fsdp_config": {"fsdp_version": 2, **{f"fsdp_{k}": v for k, v in FSDP2_SPELLING["fsdp_config"].items()}}},
    ],
    ids=["sharding_strategy_under_version_2", "version_inside_fsdp_config"],
)
def test_an_fsdp2_config_with_fsdp1_leftovers_means_the_same(tmp_path, axolotl_spelling):
    lora = {"adapter": "lora", "lora_target_linear": True}
    same_config(tmp_path, {**axolotl_spelling, **lora}, {**FSDP2_SPELLING, **lora})


def test_fsdp_version_inside_and_outside_fsdp_config_must_agree(tmp_path):
    with pytest.raises(ConfigError, match="`fsdp_config.fsdp_version: 1` and `fsdp_version: 2` differ"):
        validate_config(base_config(tmp_path, fsdp_version=2, fsdp_config={"fsdp_version": 1}))


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


def test_unfrozen_parameters_that_match_nothing_are_refused(tmp_path):
    from hellbender.train.run import train

    with pytest.raises(ConfigError, match=r"`unfrozen_parameters`: `\^transformer\.h` match no parameter"):
        train(validate_config(base_config(tmp_path, max_steps=1, unfrozen_parameters=["^transformer.h"])))


def tiny_model_for(cfg):
    from hellbender.models.loading import load_model, load_tokenizer

    return load_model(cfg, load_tokenizer(cfg))


@pytest.mark.parametrize("targets", [{"lora_target_linear": True}, {"lora_target_modules": ["q_proj", "down_proj"]}])
def test_with_an_adapter_unfrozen_parameters_choose_the_adapted_layers(tmp_path, targets):
    from hellbender.models.adapters import apply_adapter

    cfg = validate_config(
        base_config(tmp_path, adapter="lora", unfrozen_parameters=[r"^model\.layers\.1\."], **targets)
    )
    model = apply_adapter(cfg, tiny_model_for(cfg))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trained and all(".layers.1." in name and ".lora_" in name for name in trained), trained
    wanted = {"q_proj", "down_proj"} if "lora_target_modules" in targets else {"q_proj", "o_proj", "gate_proj"}
    assert wanted <= {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trained}


def test_with_an_adapter_unfrozen_parameters_matching_no_adapted_layer_are_refused(tmp_path):
    from hellbender.models.adapters import apply_adapter

    cfg = validate_config(
        base_config(tmp_path, adapter="lora", lora_target_linear=True, unfrozen_parameters=[r"^model\.language_model"])
    )
    with pytest.raises(ConfigError, match=r"`unfrozen_parameters` matches none of the layers LoRA adapts"):
        apply_adapter(cfg, tiny_model_for(cfg))


def test_rank_stabilised_lora_scales_by_the_square_root_of_the_rank(tmp_path):
    from hellbender.models.adapters import apply_adapter

    cfg = validate_config(base_config(tmp_path, adapter="lora", lora_r=16, lora_alpha=8, peft_use_rslora=True))
    model = apply_adapter(cfg, tiny_model_for(cfg))
    from peft.tuners.lora import LoraLayer

    scalings = {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)}
    assert scalings == {8 / 16**0.5}


def test_model_config_overrides_reach_the_loaded_model(tmp_path):
    cfg = validate_config(base_config(tmp_path, model_config={"rms_norm_eps": 1e-3}))  # Axolotl's older spelling
    assert cfg.overrides_of_model_config == {"rms_norm_eps": 1e-3}
    assert tiny_model_for(cfg).config.rms_norm_eps == 1e-3
    with pytest.raises(ConfigError, match=r"`overrides_of_model_config.rms_norm_epsilon`: the model's config"):
        tiny_model_for(validate_config(base_config(tmp_path, overrides_of_model_config={"rms_norm_epsilon": 1e-3})))


def test_experts_implementation_chooses_how_the_experts_compute_the_same_outputs(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    from hellbender.models.tiny import tiny_model_dir

    torch.manual_seed(0)
    moe = MixtralConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    MixtralForCausalLM(moe).save_pretrained(tmp_path / "moe")
    tokens = torch.arange(3, 40).unsqueeze(0)
    logits = {}
    for name in ("eager", "grouped_mm", "batched_mm"):
        keys = dict(base_model=str(tmp_path / "moe"), tokenizer_config=str(tiny_model_dir("hellbender/tiny-llama")))
        model = tiny_model_for(validate_config(base_config(tmp_path, experts_implementation=name, **keys)))
        assert model.config._experts_implementation == name
        logits[name] = model(tokens).logits
    torch.testing.assert_close(logits["grouped_mm"], logits["eager"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits["batched_mm"], logits["eager"], rtol=1e-4, atol=1e-5)


def test_experts_implementation_is_checked_against_the_installed_transformers_and_the_model(tmp_path):
    dense = validate_config(base_config(tmp_path, experts_implementation="grouped_mm"))
    with pytest.raises(ConfigError, match=r"`experts_implementation: grouped_mm` cannot be used with this model"):
        tiny_model_for(dense)
    with pytest.raises(
        ConfigError,
        match=r"`experts_implementation`.*`grouped_mm`.*`scattermoe`, \.\.\.\) belong to mixture-of-experts",
    ):
        validate_config(base_config(tmp_path, experts_implementation="scattermoe"))


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


@pytest.mark.parametrize("mode", [True, "legacy", "hidden_states"])
def test_activation_offloading_is_offloaded_checkpointing(tmp_path, mode):
    same_config(
        tmp_path,
        {"gradient_checkpointing": True, "activation_offloading": mode},
        {"gradient_checkpointing": "offload"},
    )
    with pytest.raises(ConfigError, match=r"`activation_offloading: disk` is not offered"):
        validate_config(base_config(tmp_path, gradient_checkpointing=True, activation_offloading="disk"))
    with pytest.raises(ConfigError, match=r"`gradient_checkpointing` is False: set it to true"):
        validate_config(base_config(tmp_path, gradient_checkpointing=False, activation_offloading=True))


@pytest.mark.parametrize(
    ("axolotl", "hellbender"),
    [
        ({"save_strategy": "epoch"}, {"saves_per_epoch": 1}),
        ({"save_strategy": "steps", "save_steps": 3}, {"save_steps": 3}),
        ({"eval_strategy": "epoch", "val_set_size": 0.25}, {"evals_per_epoch": 1, "val_set_size": 0.25}),
        ({"evaluation_strategy": False}, {}),  # a bare `no` in YAML, without evaluation data
        ({"evals_per_epoch": 0, "saves_per_epoch": 0}, {}),
        ({"bfloat16": True, "bf16": None}, {"bf16": True}),
        ({"float16": True, "bf16": False}, {"fp16": True, "bf16": False}),
        # Axolotl's pair for half-precision weights without mixed precision: its llama-2/gptq-lora.yml
        ({"float16": True, "fp16": False, "bf16": False}, {"fp16": True, "bf16": False}),
        ({"bfloat16": True, "bf16": False}, {"bf16": True}),
        ({"bfloat16": False}, {}),
        ({"use_tensorboard": True}, {"report_to": ["tensorboard"], "use_tensorboard": True}),
        ({"low_cpu_mem_usage": True, "experimental_skip_move_to_device": True}, {}),
    ],
    ids=str,
)
def test_axolotl_schedule_precision_and_loader_keys_mean_what_they_say(tmp_path, axolotl, hellbender):
    ignore = ("low_cpu_mem_usage", "experimental_skip_move_to_device") if "low_cpu_mem_usage" in axolotl else ()
    same_config(tmp_path, axolotl, hellbender, ignore=ignore)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"save_strategy": "steps"}, r"`save_strategy: steps` needs `save_steps`"),
        ({"save_strategy": False}, r"`save_strategy: no` is not offered: hellbender always writes checkpoints"),
        ({"save_strategy": "best"}, r"`save_strategy: best` is not offered"),
        ({"eval_strategy": "epoch", "eval_steps": 2}, r"`eval_strategy: epoch` and `eval_steps`"),
        ({"eval_strategy": "no", "val_set_size": 0.25}, r"`eval_strategy: no` asks for no evaluation"),
        ({"evaluation_strategy": False, "val_set_size": 0.25}, r"`eval_strategy: no` asks for no evaluation"),
        ({"bfloat16": True, "bf16": True, "fp16": True}, r"`bf16: true` and `fp16: true` are both set"),
    ],
)
def test_axolotl_schedule_and_precision_keys_that_contradict_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_sharegpt_entries_are_chat_template_entries_reading_sharegpt_keys(tmp_path):
    from tests.conftest import write_jsonl

    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]
    path = str(write_jsonl(tmp_path / "sharegpt.jsonl", rows))
    same_config(
        tmp_path,
        {"datasets": [{"path": path, "type": "sharegpt", "conversation": "chatml"}]},
        {
            "datasets": [
                {
                    "path": path,
                    "type": "chat_template",
                    "chat_template": "chatml",
                    "field_messages": "conversations",
                    "message_property_mappings": {"role": "from", "content": "value"},
                    "roles": {"user": ["human"], "assistant": ["gpt"], "system": ["system"]},
                }
            ]
        },
    )
    with pytest.raises(ConfigError, match=r"`conversation: vicuna_v1.1` \(of `type: sharegpt`\) is not a chat"):
        validate_config(
            base_config(tmp_path, datasets=[{"path": path, "type": "sharegpt", "conversation": "vicuna_v1.1"}])
        )


def test_base_model_config_naming_the_base_model_is_where_the_config_is_read_from(tmp_path):
    same_config(tmp_path, {"base_model_config": "hellbender/tiny-llama"}, {})
    with pytest.raises(ConfigError, match=r"`base_model_config: other/model` reads the model's config from elsewhere"):
        validate_config(base_config(tmp_path, base_model_config="other/model"))


def test_reinit_weights_starts_from_seeded_random_weights_and_trains(tmp_path):
    from safetensors.torch import load_file

    from hellbender.models.tiny import tiny_model_dir
    from hellbender.train.run import train

    cfg = validate_config(base_config(tmp_path, reinit_weights=True, max_steps=2))
    first, second = tiny_model_for(cfg).state_dict(), tiny_model_for(cfg).state_dict()
    trained = load_file(tiny_model_dir("hellbender/tiny-llama") / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(first[name], second[name]) and not torch.equal(first[name], trained[name])
    other_seed = tiny_model_for(validate_config(base_config(tmp_path, reinit_weights=True, seed=7))).state_dict()
    assert not torch.equal(first[name], other_seed[name])
    metrics = train(cfg)
    assert math.isfinite(metrics["train_loss"])
    saved = load_file(tmp_path / "out" / "model.safetensors")[name]
    assert not torch.equal(saved, first[name]) and not torch.equal(
        saved, trained[name]
    )  # trained from the random start


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"reinit_weights": True, "adapter": "lora"}, r"`reinit_weights: true` starts from random weights"),
        ({"bnb_config_kwargs": {"bnb_4bit_use_double_quant": False}}, r"`bnb_config_kwargs` sets QLoRA's"),
        ({"adapter": "qlora", "bnb_config_kwargs": {"bnb_4bit_quant_type": "int4"}}, r"`bnb_config_kwargs.bnb_4bit_qu"),
    ],
)
def test_reinit_weights_and_bnb_settings_that_cannot_work_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_bnb_config_kwargs_are_read_with_qlora(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, adapter="qlora", bnb_config_kwargs={"bnb_4bit_quant_type": "fp4"}, bf16=True)
    )
    assert cfg.bnb_settings.bnb_4bit_quant_type == "fp4" and cfg.bnb_settings.bnb_4bit_use_double_quant


@pytest.mark.parametrize(
    ("patch", "liger_key"), [("flash_attn_fuse_mlp", "liger_glu_activation"), ("flash_attn_rms_norm", "liger_rms_norm")]
)
def test_axolotls_fused_module_patches_are_ligers_kernels(tmp_path, patch, liger_key):
    same_config(tmp_path, {patch: True}, {liger_key: True})
    same_config(tmp_path, {patch: False}, {})
    with pytest.raises(ConfigError, match=rf"`{patch}: true` asks for Liger's .* \(`{liger_key}`\), which is set"):
        validate_config(base_config(tmp_path, **{patch: True, liger_key: False}))


@pytest.mark.parametrize("attn", [{}, {"attn_implementation": "flash_attention_2"}, {"attn_implementation": "sdpa"}])
def test_gemma4_hybrid_attention_is_sdpa_on_every_layer(tmp_path, attn):
    same_config(tmp_path, {"gemma4_hybrid_attn_impl": True, **attn}, {"attn_implementation": "sdpa"})
    same_config(tmp_path, {"gemma4_hybrid_attn_impl": False}, {})
    with pytest.raises(ConfigError, match=r"`gemma4_hybrid_attn_impl: true` picks Gemma 4's attention kernels"):
        validate_config(base_config(tmp_path, gemma4_hybrid_attn_impl=True, attn_implementation="eager"))


def test_field_of_a_pretraining_entry_is_its_text_column(tmp_path):
    stream = {"path": "p.jsonl", "ds_type": "json"}
    same_config(
        tmp_path,
        {"max_steps": 2, "datasets": [], "pretraining_dataset": [{**stream, "field": "body"}]},
        {"max_steps": 2, "datasets": [], "pretraining_dataset": [{**stream, "text_column": "body"}]},
    )
    with pytest.raises(ConfigError, match="both name the text column"):
        validate_config(
            base_config(
                tmp_path,
                max_steps=2,
                datasets=[],
                pretraining_dataset=[{**stream, "field": "body", "text_column": "text"}],
            )
        )
