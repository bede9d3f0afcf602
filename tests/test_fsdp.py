"""FSDP2: the config reaches the Trainer as written, fp32 norms get their own float32 groups, and sharded
checkpoints consolidate into a model that transformers and PEFT load.

accelerate applies FSDP2 only on accelerators, so the two-process parts here run on CPU (gloo) with
tests/fsdp_worker.py, which shards the model as accelerate does around hellbender's own pieces. The whole path
through the Trainer runs on two GPUs in tests/test_gpu_multi.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import validate_config
from hellbender.models.loading import load_model, load_tokenizer_and_processor
from hellbender.train.arguments import training_arguments
from hellbender.train.fsdp import check_fsdp_plugin_arguments, matches_norm_class, norm_modules
from hellbender.train.schedule import plan_schedule
from tests.helpers import base_config
from tests.test_distributed import run_torchrun

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "fsdp_worker.py"


def fsdp_config(tmp_path: Path, **overrides) -> dict:
    return base_config(
        tmp_path, fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, **overrides
    )


def test_fsdp_config_reaches_the_trainer_as_written(tmp_path):
    raw = fsdp_config(tmp_path)
    raw["fsdp_config"] = {
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",  # the older prefixed spelling
        "fsdp_offload_params": True,
        "reshard_after_forward": False,
        "state_dict_type": "FULL_STATE_DICT",
    }
    cfg = validate_config(raw)
    args = training_arguments(cfg, plan_schedule(cfg, 32, 2), has_eval=False)
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert plugin["cpu_offload"] is True and plugin["reshard_after_forward"] is False
    assert plugin["state_dict_type"] == "FULL_STATE_DICT"
    assert plugin["activation_checkpointing"] is False  # hellbender checkpoints layers itself


def test_a_setting_the_installed_transformers_reads_differently_is_refused(tmp_path):
    cfg = validate_config(fsdp_config(tmp_path))
    args = training_arguments(cfg, plan_schedule(cfg, 32, 2), has_eval=False)
    misread = {**args.fsdp_plugin_args, "fsdp_version": 1}
    with pytest.raises(Exception, match="read hellbender's FSDP settings differently"):
        check_fsdp_plugin_arguments(cfg, misread)


def test_without_fsdp_the_trainer_gets_no_fsdp_arguments(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    args = training_arguments(cfg, plan_schedule(cfg, 32, 1), has_eval=False)
    assert not args.fsdp


def test_fsdp_on_cpu_processes_is_refused_rather_than_silently_unsharded(monkeypatch):
    from hellbender.errors import ConfigError
    from hellbender.train.fsdp import check_fsdp_processes

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; this machine has no GPU
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        check_fsdp_processes()


def test_norm_patterns_match_class_name_suffixes_or_full_paths(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    model = load_model(cfg, tokenizer)
    rms = model.model.norm
    assert matches_norm_class(rms, ["RMSNorm"])
    assert matches_norm_class(rms, [f"{type(rms).__module__}.{type(rms).__qualname__}"])
    assert not matches_norm_class(rms, ["transformers.RMSNorm"])  # a dotted pattern is a full path, not a suffix
    assert not matches_norm_class(rms, ["", "  "])  # empty patterns match nothing (not everything)
    layers = model.config.num_hidden_layers
    assert len(norm_modules(model, ["RMSNorm"])) == 2 * layers + 1  # two per layer, one final
    assert len(norm_modules(model, ["LayerNorm"])) == 0


@pytest.fixture
def tiny_model_built(tiny_model_path) -> None:
    """The tiny model built in this process first: two workers starting together would both build it at once."""


def run_workers(tmp_path: Path, raw: dict) -> dict:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    run_torchrun(WORKER, str(config), str(tmp_path), OMP_NUM_THREADS="1")
    return json.loads((tmp_path / "report.json").read_text())


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_path):  # tiny_model_path: see `tiny_model_built`
    tmp = tmp_path_factory.mktemp("fsdp-lora")
    raw = fsdp_config(tmp, bf16=True, adapter="lora", lora_target_linear=True, lora_dropout=0.0, fp32_norms=True)
    return tmp, raw, run_workers(tmp, raw)


def test_fp32_norms_keep_norms_in_float32_and_the_rest_in_bfloat16(lora_run):
    _, _, report = lora_run
    assert report["norms"] == 5  # tiny Llama: 2 layers x 2 norms + the final norm
    assert all(torch.isfinite(torch.tensor(report["losses"])))
    stored, compute = report["stored"], report["compute"]
    norm_params = {n: d for n, d in stored.items() if "norm" in n}
    assert norm_params and set(norm_params.values()) == {"torch.float32"}
    # During the forward (after a step), the norms compute with float32 weights, the projections with bfloat16.
    assert compute["FSDPLlamaRMSNorm.weight"] == "torch.float32"  # FSDP2 renames the classes it shards
    assert compute["Linear.weight"] == "torch.bfloat16"
    assert "torch.bfloat16" in {d for n, d in stored.items() if "norm" not in n}  # the frozen base stays bf16


def test_fused_lora_layers_under_fsdp2_train_to_the_unfused_losses(lora_run):
    """The fused LoRA function reads each base weight inside the LoRA layer (and keeps it for backward, as a linear
    layer does): under FSDP2, which gathers a decoder layer's weights for its forward and again for its backward, the
    two steps give the unfused run's losses (bf16, two gloo processes)."""
    tmp, raw, report = lora_run
    kernels = {"lora_qkv_kernel": True, "lora_o_kernel": True, "lora_mlp_kernel": True}
    (tmp / "fused").mkdir(exist_ok=True)
    fused = run_workers(tmp / "fused", {**raw, **kernels, "output_dir": str(tmp / "fused" / "out")})
    assert report["fused_lora_layers"] == 0 and fused["fused_lora_layers"] == 14
    assert fused["losses"] == pytest.approx(report["losses"], rel=1e-3)
    assert fused["losses"][1] != report["losses"][1]  # the fused path ran (bf16 rounds its sums differently)


def test_sharded_lora_checkpoint_consolidates_into_an_adapter_peft_loads(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, raw, _ = lora_run
    raw = {**raw, "output_dir": str(tmp / "run")}
    config = tmp / "config.yml"
    config.write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["consolidate", str(config)])  # the newest checkpoint by default
    assert result.exit_code == 0, result.output
    target = tmp / "run" / "consolidated"
    assert (target / "adapter_model.safetensors").is_file() and (target / "hellbender_model.json").is_file()
    reference = torch.load(tmp / "reference_state_dict.pt", weights_only=True)
    cfg = validate_config(raw)
    base = AutoModelForCausalLM.from_pretrained(str(load_model_path(cfg)), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(target))
    got = loaded.state_dict()
    lora_keys = [k for k in reference if "lora_" in k]
    assert lora_keys
    for key in lora_keys:
        torch.testing.assert_close(got[key].float(), reference[key].float())


def load_model_path(cfg) -> Path:
    from hellbender.models.loading import resolve_model_path

    return Path(resolve_model_path(cfg.base_model))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_path):  # tiny_model_path: see `tiny_model_built`
    tmp = tmp_path_factory.mktemp("fsdp-full")
    raw = fsdp_config(tmp, bf16=True)
    return tmp, raw, run_workers(tmp, raw)


def test_each_process_holds_the_shards_hellbender_plan_counts_per_gpu(full_run):
    """Full fine-tuning in bf16 on two processes: each holds half of the weights, gradients and AdamW states, the
    trained weights kept in float32 as accelerate keeps them (so their gradients and states are float32 too). The
    plan's per-GPU parts are those bytes (the weights' beside the layers FSDP2 gathers whole while they compute)."""
    from hellbender.plan.fit import element_size
    from hellbender.plan.memory import plan_memory
    from hellbender.plan.model_facts import describe, meta_model
    from hellbender.plan.settings import plan_settings

    _, raw, report = full_run
    cfg = validate_config(raw)
    facts = describe(cfg, meta_model(cfg))
    planned = plan_memory(facts, plan_settings(cfg, gpus=2, facts=facts), element_size(cfg))
    whole = sum(p.numel for p in facts.parameters)
    assert planned.weights - planned.gathered_weights == 4 * whole // 2  # float32, halved
    assert len(report["held_bytes"]) == 2
    for held in report["held_bytes"]:
        assert held["parameters"] == planned.weights - planned.gathered_weights
        assert held["gradients"] == planned.gradients
        # AdamW's two float32 states per weight; the step counters (one scalar per tensor) are what may differ
        assert held["optimizer_states"] == pytest.approx(planned.optimizer_states, rel=0.01)


def test_sharded_full_checkpoint_consolidates_into_a_model_transformers_loads(full_run):
    from transformers import AutoModelForCausalLM

    tmp_path, raw, _ = full_run
    raw = {**raw, "output_dir": str(tmp_path / "run")}
    config = tmp_path / "config.yml"
    config.write_text(json.dumps(raw))
    target = tmp_path / "whole"
    result = CliRunner().invoke(
        app,
        ["consolidate", str(config), "--checkpoint", str(tmp_path / "run" / "checkpoint-2"), "--output", str(target)],
    )
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(str(target))
    reference = torch.load(tmp_path / "reference_state_dict.pt", weights_only=True)
    got = model.state_dict()
    for key, tensor in reference.items():
        torch.testing.assert_close(got[key], tensor.to(got[key].dtype))  # saved in the run's dtype (bf16)
    untrained = load_model(
        validate_config(base_config(tmp_path / "fresh", bf16=True)),
        load_tokenizer_and_processor(validate_config(base_config(tmp_path / "fresh", bf16=True)))[0],
    )
    assert not torch.equal(
        untrained.state_dict()["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.up_proj.weight"]
    )


def test_consolidating_a_checkpoint_without_shards_says_what_it_holds(tmp_path):
    from hellbender.storage import write_manifest

    checkpoint = tmp_path / "out" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_model.safetensors").write_bytes(b"x")
    write_manifest(checkpoint)
    config = tmp_path / "config.yml"
    config.write_text(json.dumps(base_config(tmp_path)))
    result = CliRunner().invoke(app, ["consolidate", str(config)])
    assert result.exit_code == 2
    assert "holds no sharded weights" in result.stderr and "checkpoint-3" in result.stderr


HYBRID_WORKER = REPO / "tests" / "fsdp_hybrid_worker.py"


@pytest.mark.parametrize(
    ("sizes", "processes", "shape"),
    [
        ({"dp_shard_size": 2, "dp_replicate_size": 2}, 4, (2, 2)),
        ({"dp_shard_size": 4}, 8, (2, 4)),  # the replicas fill the processes the shard groups leave
        ({"dp_replicate_size": 2}, 8, (2, 4)),
        ({"dp_shard_size": 4}, 4, None),  # one group over all processes: plain FSDP2
    ],
)
def test_hybrid_sharding_sizes_fill_the_processes(tmp_path, sizes, processes, shape):
    from hellbender.config.hybrid_sharding import hybrid_shape

    assert hybrid_shape(validate_config(fsdp_config(tmp_path, **sizes)), processes) == shape


@pytest.mark.parametrize(
    ("sizes", "processes"),
    [({"dp_shard_size": 2, "dp_replicate_size": 2}, 8), ({"dp_shard_size": 3}, 4), ({"dp_replicate_size": 4}, 4)],
)
def test_hybrid_sharding_sizes_that_do_not_fill_the_processes_are_refused_with_the_numbers(tmp_path, sizes, processes):
    from hellbender.config.hybrid_sharding import hybrid_shape
    from hellbender.errors import ConfigError

    cfg = validate_config(fsdp_config(tmp_path, **sizes))
    with pytest.raises(ConfigError, match=rf"must equal the number of training processes, {processes}") as error:
        hybrid_shape(cfg, processes)
    assert f"`dp_shard_size` ({sizes.get('dp_shard_size', 'unset')})" in str(error.value)


def test_fp32_norms_with_replicas_left_to_fill_the_processes_are_refused_when_the_run_starts(tmp_path):
    from hellbender.config.hybrid_sharding import hybrid_shape
    from hellbender.errors import ConfigError

    cfg = validate_config(fsdp_config(tmp_path, dp_shard_size=2, fp32_norms=True, bf16=True))  # replicas not named
    assert hybrid_shape(cfg, 2) is None  # one group: plain FSDP2, fp32 norms work
    with pytest.raises(ConfigError, match=r"`fp32_norms` with hybrid sharding \(2 replicas of `dp_shard_size: 2`\)"):
        hybrid_shape(cfg, 4)


def test_hybrid_sharding_reaches_the_trainer_as_accelerates_parallelism_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it
    cfg = validate_config(fsdp_config(tmp_path, dp_shard_size=2, dp_replicate_size=2))
    from hellbender.train.fsdp import fsdp_arguments

    pc = fsdp_arguments(cfg)["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 2)
    assert pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]  # the 2-D mesh accelerate gives fully_shard
    assert "parallelism_config" not in fsdp_arguments(validate_config(fsdp_config(tmp_path)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fsdp_version": None, "fsdp_config": None, "dp_shard_size": 2}, "but `fsdp_version: 2` is not set"),
        ({"dp_shard_size": 1}, "`dp_shard_size: 1` shards nothing"),
        ({"dp_replicate_size": 2, "fp32_norms": True, "bf16": True}, "`fp32_norms` with hybrid sharding"),
    ],
)
def test_hybrid_sharding_settings_that_cannot_work_are_refused(tmp_path, overrides, message):
    from hellbender.errors import ConfigError

    raw = {k: v for k, v in {**fsdp_config(tmp_path), **overrides}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        validate_config(raw)


def test_hybrid_sharding_two_by_two_trains_like_plain_fsdp2_on_four_processes(tmp_path, tiny_model_built):
    raw = base_config(
        tmp_path,
        adapter="lora",
        lora_target_linear=True,
        lora_dropout=0.0,
        fsdp_version=2,
        fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
        dp_shard_size=2,
        dp_replicate_size=2,
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    run_torchrun(HYBRID_WORKER, str(config), str(tmp_path), nproc=4, timeout=600, OMP_NUM_THREADS="1")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["hybrid"]["mesh"] == [2, 2] and report["hybrid"]["dims"] == ["dp_replicate", "dp_shard_cp"]
    assert report["plain"]["mesh"] == [4]
    # Tolerance: float32 reduction order only (all-reduce over replicas after the reduce-scatter in each group).
    assert report["hybrid"]["losses"] == pytest.approx(report["plain"]["losses"], rel=1e-6)
    grads = torch.load(tmp_path / "grads.pt", weights_only=True)
    assert set(grads["hybrid"]) == set(grads["plain"])
    for name, grad in grads["plain"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads["hybrid"][name], grad, rtol=1e-5, atol=1e-8)
