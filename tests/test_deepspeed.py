"""DeepSpeed ZeRO from a `deepspeed:` JSON file: what validation checks in the file, the values hellbender hands to
transformers, and the message when the optional package is missing. CI installs no `deepspeed` (the `dev` extra
leaves it out), so the not-installed path runs for real there. Training under ZeRO-2 / ZeRO-3 is tested on two GPUs
in tests/test_gpu_deepspeed.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import HellbenderConfig, validate_config
from hellbender.config.deepspeed import contradictions, read_deepspeed_json
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.train.deepspeed import deepspeed_config, precision_at_run_time, settings_for_loading
from tests.conftest import EXAMPLES
from tests.helpers import base_config

BUNDLED = {name: EXAMPLES / "deepspeed" / f"{name}.json" for name in ("zero2", "zero3")}
PACKAGE_PARAGRAPH = "needs the `deepspeed` package"
INSTALL_HINT = "pip install 'hellbender[deepspeed]'"
without_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None,
    reason="deepspeed is installed here; CI (no deepspeed) runs this against the really missing package",
)


@pytest.fixture(autouse=True)
def _not_in_a_launched_process(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


def write_settings(tmp_path: Path, settings: dict | str) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return path


def problems_of(tmp_path: Path, settings: dict | str | Path, unset: tuple[str, ...] = (), **overrides) -> list[str]:
    """The paragraphs validation reports, less the one about the package (whether it is installed or not)."""
    path = settings if isinstance(settings, Path) else write_settings(tmp_path, settings)
    raw = base_config(tmp_path, deepspeed=str(path), **overrides)
    try:
        validate_config({k: v for k, v in raw.items() if k not in unset})
    except ConfigError as exc:
        return [p for p in str(exc).split("\n\n") if PACKAGE_PARAGRAPH not in p]
    return []


def config_for(tmp_path: Path, settings: dict, **overrides) -> HellbenderConfig:
    """A validated config whose `deepspeed:` is set afterwards (validation would stop at the missing package)."""
    cfg = validate_config(base_config(tmp_path, **overrides))
    return cfg.model_copy(update={"deepspeed": str(write_settings(tmp_path, settings))})


# ---------------------------------------------------------------------------------------- accepted files


@pytest.mark.parametrize("name", sorted(BUNDLED))
@pytest.mark.parametrize("precision", [dict(bf16=True), dict(bf16=False), dict(bf16=False, fp16=True), {}])
def test_bundled_configs_are_all_auto_and_pass_validation(tmp_path, name, precision):
    settings = read_deepspeed_json(str(BUNDLED[name]))
    assert settings["zero_optimization"]["stage"] == int(name[-1])
    assert problems_of(tmp_path, BUNDLED[name], micro_batch_size=3, gradient_accumulation_steps=2, **precision) == []


def test_values_written_out_that_agree_with_the_config_are_accepted(tmp_path):
    settings = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 12,  # two processes
        "gradient_clipping": 0.5,
        "bf16": {"enabled": False},
        "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    }
    overrides = dict(micro_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.5, bf16=False, fp16=True)
    assert problems_of(tmp_path, settings, learning_rate=1e-4, weight_decay=0.01, **overrides) == []


# ---------------------------------------------------------------------------------------- broken files


def test_invalid_json_names_the_file_and_the_line(tmp_path):
    text = '{\n  "zero_optimization": {"stage": 2},\n  "gradient_clipping": "auto",\n}\n'
    (problem,) = problems_of(tmp_path, text)
    assert problem.startswith(f"`deepspeed: {tmp_path / 'ds.json'}` is not valid JSON")
    assert "at line 4, column 1: `}`" in problem
    assert "no trailing commas" in problem


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "is not valid JSON: Expecting value at line 1, column 1"),
        ("// ZeRO-2\n{}", "is not valid JSON"),
        ('[{"zero_optimization": {"stage": 2}}]', "holds a JSON list; a DeepSpeed config is a JSON object"),
        ('{"zero_optimization": {"stage": 2, "stage": 3}}', "`stage` is set twice in one JSON object"),
    ],
)
def test_unreadable_files_are_refused_with_one_paragraph(tmp_path, text, expected):
    (problem,) = problems_of(tmp_path, text)
    assert expected in problem


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"zero_optimization": {"stage": 2}, "x": "\xff"}')
    (problem,) = problems_of(tmp_path, path)
    assert "is not UTF-8 text" in problem


@pytest.mark.parametrize(
    "settings",
    [{}, {"zero_optimization": {}}, {"zero_optimization": True}, {"bf16": {"enabled": "auto"}}],
    ids=["empty", "no-stage", "old-boolean-form", "other-keys-only"],
)
def test_a_missing_stage_is_refused(tmp_path, settings):
    (problem,) = problems_of(tmp_path, settings)
    assert "has no `zero_optimization.stage`" in problem
    assert '"zero_optimization": {"stage": 2}' in problem


@pytest.mark.parametrize("stage", [4, -1, "auto", "2", True, 2.5])
def test_a_stage_outside_0_to_3_is_refused(tmp_path, stage):
    (problem,) = problems_of(tmp_path, {"zero_optimization": {"stage": stage}})
    assert f"`zero_optimization.stage` is {json.dumps(stage)}; it must be 0, 1, 2 or 3" in problem


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_are_accepted(tmp_path, stage):
    assert problems_of(tmp_path, {"zero_optimization": {"stage": stage}}) == []


@pytest.mark.parametrize("stage", [1, 2])
def test_qlora_is_accepted_with_zero_1_and_2(tmp_path, stage):
    qlora = dict(adapter="qlora", load_in_4bit=True, bf16=True)
    assert problems_of(tmp_path, {"zero_optimization": {"stage": stage}}, **qlora) == []


def test_qlora_with_zero3_and_an_8bit_base_are_refused_with_what_to_use(tmp_path):
    (problem,) = problems_of(tmp_path, BUNDLED["zero3"], adapter="qlora", load_in_4bit=True, bf16=True)
    assert problem.startswith("QLoRA (`load_in_4bit`) with ZeRO-3")
    assert "Use ZeRO-2" in problem and "`fsdp_version: 2`" in problem
    (problem,) = problems_of(tmp_path, BUNDLED["zero2"], adapter="lora", load_in_8bit=True)
    assert problem.startswith("`load_in_8bit` with `deepspeed` is not supported yet")


@pytest.mark.parametrize("gather", [None, False, "auto"])
def test_zero3_must_save_16bit_weights_for_a_loadable_model(tmp_path, gather):
    zero = {"stage": 3} | ({} if gather is None else {"stage3_gather_16bit_weights_on_model_save": gather})
    (problem,) = problems_of(tmp_path, {"zero_optimization": zero})
    assert '"stage3_gather_16bit_weights_on_model_save": true' in problem
    assert "transformers and PEFT cannot load" in problem


def test_the_old_bfloat16_key_is_refused(tmp_path):
    (problem,) = problems_of(tmp_path, {"zero_optimization": {"stage": 2}, "bfloat16": {"enabled": True}})
    assert "`bfloat16` is DeepSpeed's old name for `bf16`" in problem


# ---------------------------------------------------------------------------------------- contradictions


@pytest.mark.parametrize(
    ("settings", "overrides", "expected"),
    [
        (
            {"train_micro_batch_size_per_gpu": 8},
            dict(micro_batch_size=4),
            [
                "`train_micro_batch_size_per_gpu` is 8",
                "`micro_batch_size: 4`",
                '"train_micro_batch_size_per_gpu": "auto"',
            ],
        ),
        (
            {"gradient_accumulation_steps": 4},
            dict(gradient_accumulation_steps=2),
            [
                "`gradient_accumulation_steps` is 4",
                "`gradient_accumulation_steps: 2`",
                '"gradient_accumulation_steps": "auto"',
            ],
        ),
        (
            {"gradient_clipping": 0.5},
            dict(max_grad_norm=1.0),
            ["`gradient_clipping` is 0.5", "`max_grad_norm: 1.0`", '"gradient_clipping": "auto"'],
        ),
        (
            {"bf16": {"enabled": True}},
            dict(bf16=False),
            ["`bf16.enabled` is true", "`bf16: false`", '"bf16": {"enabled": "auto"}'],
        ),
        (
            {"bf16": {"enabled": False}},
            dict(bf16=True),
            ["`bf16.enabled` is false", "`bf16: true`", '"bf16": {"enabled": "auto"}'],
        ),
        (
            {"fp16": {"enabled": True}},
            dict(bf16=False),
            ["`fp16.enabled` is true", "`fp16: false`", '"fp16": {"enabled": "auto"}'],
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            dict(learning_rate=1e-4),
            ["`optimizer.params.lr` is 0.1", "`learning_rate: 0.0001`", '"optimizer": {"params": {"lr": "auto"}}'],
        ),
        (
            {"train_batch_size": 6},
            dict(micro_batch_size=2, gradient_accumulation_steps=2),
            ["`train_batch_size` is 6", "(4) times a number of processes", '"train_batch_size": "auto"'],
        ),
    ],
    ids=["micro-batch", "accumulation", "clipping", "bf16-on", "bf16-off", "fp16", "learning-rate", "total-batch"],
)
def test_a_value_that_contradicts_the_config_names_both_keys_and_the_fix(tmp_path, settings, overrides, expected):
    (problem,) = problems_of(tmp_path, {"zero_optimization": {"stage": 2}, **settings}, **overrides)
    assert problem.startswith(f"`deepspeed: {tmp_path / 'ds.json'}`")
    for needle in expected:
        assert needle in problem, f"{needle!r} not in {problem!r}"


def test_every_contradiction_is_reported_at_once(tmp_path):
    settings = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 9.0}
    problems = problems_of(tmp_path, settings, micro_batch_size=4)
    assert len(problems) == 2


def test_bf16_auto_is_checked_where_the_run_resolves_it(tmp_path):
    settings = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    assert problems_of(tmp_path, settings, bf16="auto") == []  # a bf16 GPU would agree
    cfg = config_for(tmp_path, settings, bf16="auto")
    bf16, fp16 = precision_at_run_time(cfg)
    assert (bf16, fp16) == (False, False)  # this machine has no GPU: bf16 auto means float32
    (problem,) = contradictions(cfg, settings, bf16, fp16, world=1)
    assert "`bf16.enabled` is true" in problem and "`bf16: auto`" in problem and "off on this machine" in problem


def test_the_total_batch_is_checked_exactly_inside_launched_processes(tmp_path, monkeypatch):
    settings = {"zero_optimization": {"stage": 2}, "train_batch_size": 8}
    # `hellbender train --nproc N` validates once before it starts the processes: any multiple is possible there.
    assert problems_of(tmp_path, settings, micro_batch_size=2) == []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (problem,) = problems_of(tmp_path, settings, micro_batch_size=2)
    assert "`train_batch_size` is 8" in problem and "2 processes = 4" in problem
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert problems_of(tmp_path, settings, micro_batch_size=2) == []


def test_optimizer_and_scheduler_blocks_conflict_only_with_explicit_choices(tmp_path):
    settings = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
    }
    assert problems_of(tmp_path, settings, unset=("lr_scheduler",)) == []  # hellbender's defaults give way
    optimizer, scheduler = problems_of(tmp_path, settings, optimizer="adamw_torch", warmup_steps=3)
    assert "has an `optimizer` block, which replaces hellbender's `optimizer: adamw_torch`" in optimizer
    assert "has a `scheduler` block, which replaces the schedule set by `lr_scheduler`, `warmup_steps`" in scheduler


# ---------------------------------------------------------------------------------------- what transformers gets


def test_zero3_loading_settings_fill_the_values_the_trainer_fills(tmp_path, monkeypatch):
    """`deepspeed.zero.Init` partitions the weights while they load, before TrainingArguments exist; it must see the
    same batch sizes and precision the Trainer fills into the `"auto"` values later."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    settings = read_deepspeed_json(str(BUNDLED["zero3"])) | {"gradient_clipping": 0.3, "steps_per_print": 7}
    cfg = config_for(
        tmp_path, settings, micro_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.3, bf16=False, fp16=True
    )
    before = json.dumps(settings, sort_keys=True)
    filled = settings_for_loading(cfg, settings)
    assert json.dumps(settings, sort_keys=True) == before  # the caller's dict is left alone
    assert filled["train_micro_batch_size_per_gpu"] == 3
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 3 * 2 * 2
    assert filled["gradient_clipping"] == 0.3
    assert filled["bf16"] == {"enabled": False} and filled["fp16"] == {"enabled": True}
    assert filled["steps_per_print"] == 7
    # Bucket sizes depend on the loaded model: the Trainer fills them; DeepSpeed's loader ignores "auto" there.
    assert filled["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert filled["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_without_deepspeed_key_nothing_is_passed(tmp_path):
    from hellbender.train.arguments import training_arguments
    from hellbender.train.schedule import plan_schedule

    cfg = validate_config(base_config(tmp_path))
    assert deepspeed_config(cfg) is None
    assert training_arguments(cfg, plan_schedule(cfg, 100, 1), has_eval=False).deepspeed is None


@without_deepspeed
def test_the_run_time_mapping_refuses_without_the_package(tmp_path):
    from hellbender.train.arguments import training_arguments
    from hellbender.train.schedule import plan_schedule

    cfg = config_for(tmp_path, read_deepspeed_json(str(BUNDLED["zero2"])))
    with pytest.raises(EnvironmentProblem, match=r"pip install 'hellbender\[deepspeed\]'"):
        deepspeed_config(cfg)
    with pytest.raises(EnvironmentProblem, match=r"pip install 'hellbender\[deepspeed\]'"):
        training_arguments(cfg, plan_schedule(cfg, 100, 1), has_eval=False)


# ---------------------------------------------------------------------------------------- the CLI, package missing


def cli_config(tmp_path: Path) -> Path:
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, deepspeed=str(BUNDLED["zero3"]), adapter="lora")))
    return config


def assert_stopped_before_any_work(tmp_path: Path, exit_code: int, output: str) -> None:
    assert exit_code == 2, output
    assert "Traceback" not in output, output
    assert f"`deepspeed: {BUNDLED['zero3']}` needs the `deepspeed` package" in output, output
    assert output.count(INSTALL_HINT) == 1, output
    assert not (tmp_path / "out").exists() and not (tmp_path / "prepared").exists()


@without_deepspeed
def test_train_says_how_to_install_deepspeed_before_any_work(tmp_path):
    result = CliRunner().invoke(app, ["train", str(cli_config(tmp_path))])
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "error:" in result.stderr
    assert_stopped_before_any_work(tmp_path, result.exit_code, result.output)


@without_deepspeed
def test_validate_accepts_the_config_and_says_the_package_is_missing_here(tmp_path, caplog):
    """The package belongs to the machine that trains, which need not be the one that validates."""
    with caplog.at_level("WARNING", logger="hellbender"):
        result = CliRunner().invoke(app, ["validate", str(cli_config(tmp_path))])
    assert result.exit_code == 0, result.output
    missing = f"`deepspeed: {BUNDLED['zero3']}` needs the `deepspeed` package, which is not installed here; `train`"
    assert missing in caplog.text and INSTALL_HINT in caplog.text


@without_deepspeed
def test_a_real_multi_process_launch_stops_once_before_starting_processes(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hellbender", "train", str(cli_config(tmp_path)), "--nproc", "2"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")},
        timeout=300,
    )
    assert "torch.distributed" not in done.stderr  # torchrun was never started
    assert_stopped_before_any_work(tmp_path, done.returncode, done.stdout + done.stderr)
