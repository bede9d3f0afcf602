"""hellbender's DeepSpeed presets, named as Axolotl's `deepspeed_configs/` files: each passes hellbender's DeepSpeed
validation and means what Axolotl's file of the same name means (stage, offload, precision); a `deepspeed:` path that
does not exist but names a preset resolves to it, with one notice; a file that exists always wins."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from hellbender.config import dump_config, validate_config
from hellbender.config.deepspeed import (
    PRESET_FOLDER,
    describe_settings,
    preset_dir,
    preset_names,
    read_deepspeed_json,
    settings_problems,
    use_deepspeed_preset,
)
from hellbender.errors import ConfigError
from tests.helpers import base_config, invoke

PACKAGE_PARAGRAPH = "needs the `deepspeed` package"
REPO = Path(__file__).resolve().parent.parent

# Axolotl's file name -> what its JSON asks for (read from axolotl-ai-cloud/axolotl's deepspeed_configs/).
AXOLOTL_MEANING = {
    "zero1.json": "ZeRO-1, precision from `bf16` / `fp16`",
    "zero2.json": "ZeRO-2, optimizer states offloaded to CPU, precision from `bf16` / `fp16`",
    "zero3.json": "ZeRO-3, precision from `bf16` / `fp16`",
    "zero3_bf16.json": "ZeRO-3, bf16",
    "zero3_bf16_cpuoffload_params.json": "ZeRO-3, parameters offloaded to CPU, bf16",
    "zero3_bf16_cpuoffload_all.json": "ZeRO-3, parameters and optimizer states offloaded to CPU, bf16",
}


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Relative `deepspeed:` paths start from the current directory: a fresh one, without `deepspeed_configs/`."""
    monkeypatch.chdir(tmp_path)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


def validated(tmp_path: Path, caplog, **overrides) -> tuple[str | None, list[str], list[str]]:
    """(the resolved `deepspeed:`, the validation problems less the one about the package, the notices logged)."""
    raw = base_config(tmp_path, **overrides)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        try:
            cfg = validate_config(raw)
        except ConfigError as exc:
            problems = [p for p in str(exc).split("\n\n") if PACKAGE_PARAGRAPH not in p]
            resolved = None
        else:
            problems, resolved = [], cfg.deepspeed
    notices = [r.getMessage() for r in caplog.records if "preset" in r.getMessage()]
    return resolved, problems, notices


def test_the_presets_are_axolotls_names_with_their_meaning():
    assert preset_names() == sorted(AXOLOTL_MEANING)
    for name, meaning in AXOLOTL_MEANING.items():
        assert describe_settings(read_deepspeed_json(str(preset_dir() / name))) == meaning


@pytest.mark.parametrize("name", sorted(AXOLOTL_MEANING))
def test_each_preset_passes_deepspeed_validation(tmp_path, caplog, name):
    settings = read_deepspeed_json(str(preset_dir() / name))
    assert settings_problems(name, settings) == []
    resolved, problems, _ = validated(
        tmp_path,
        caplog,
        deepspeed=str(preset_dir() / name),
        bf16=True,
        micro_batch_size=3,
        gradient_accumulation_steps=2,
    )
    assert problems == []
    # Everything the hellbender config decides is left to it ("auto"), except a preset's fixed bf16.
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
    ):
        assert settings[key] == "auto"


@pytest.mark.parametrize("name", [n for n, meaning in AXOLOTL_MEANING.items() if meaning.endswith("bf16")])
def test_a_bf16_preset_refuses_a_config_without_bf16(tmp_path, caplog, name):
    _, problems, _ = validated(tmp_path, caplog, deepspeed=str(preset_dir() / name), bf16=False)
    assert len(problems) == 1 and "`bf16.enabled` is true there" in problems[0] and "`bf16: false`" in problems[0]


@pytest.mark.parametrize("name", [n for n, meaning in AXOLOTL_MEANING.items() if not meaning.endswith("bf16")])
@pytest.mark.parametrize("precision", [dict(bf16=False), dict(bf16=False, fp16=True)])
def test_an_auto_precision_preset_follows_the_config(tmp_path, caplog, name, precision):
    assert validated(tmp_path, caplog, deepspeed=str(preset_dir() / name), **precision)[1] == []


def test_optimizer_offload_keeps_the_trainers_optimizer():
    """DeepSpeed refuses a torch optimizer with optimizer offload unless told it may run one; the Trainer builds the
    optimizer from `optimizer:`, so the presets that offload it say so."""
    for name in preset_names():
        settings = read_deepspeed_json(str(preset_dir() / name))
        offloads = "offload_optimizer" in settings["zero_optimization"]
        assert (settings.get("zero_force_ds_cpu_optimizer") is False) == offloads, name


@pytest.mark.parametrize(
    "written",
    ["deepspeed_configs/{}", "./deepspeed_configs/{}", "{}", "/workspace/axolotl/deepspeed_configs/{}"],
)
def test_a_missing_axolotl_path_resolves_to_the_preset_with_one_notice(tmp_path, caplog, written):
    name = "zero3_bf16.json"
    resolved, problems, notices = validated(tmp_path, caplog, deepspeed=written.format(name), bf16=True)
    preset = str(preset_dir() / name)
    assert problems == []
    if resolved is not None:  # validation passes only where the deepspeed package is installed
        assert resolved == preset
    assert len(notices) == 1
    assert f"`deepspeed: {written.format(name)}` does not exist here" in notices[0]
    assert preset in notices[0] and "ZeRO-3, bf16" in notices[0]


def test_the_resolved_config_shows_the_presets_path(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    resolved, notices = use_deepspeed_preset(cfg.model_copy(update={"deepspeed": f"{PRESET_FOLDER}/zero2.json"}))
    assert resolved.deepspeed == str(preset_dir() / "zero2.json")
    assert f"deepspeed: {preset_dir() / 'zero2.json'}\n" in dump_config(resolved)
    assert len(notices) == 1
    # Validated again (each launched process loads the config again), the preset's path is simply used.
    assert use_deepspeed_preset(resolved) == (resolved, [])


def test_validate_names_the_preset_through_the_command_line(tmp_path, caplog):
    config = tmp_path / "config.yml"
    config.write_text(json.dumps(base_config(tmp_path, deepspeed="deepspeed_configs/zero2.json")))
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        result = invoke("validate", config, "--print")
    preset = str(preset_dir() / "zero2.json")
    assert "does not exist here; using hellbender's preset of that name" in caplog.text
    if result.exit_code == 0:  # the deepspeed package is installed
        assert f"deepspeed: {preset}\n" in result.stdout
    else:  # the only problem left is the missing package, and it names the preset's path
        assert f"`deepspeed: {preset}` {PACKAGE_PARAGRAPH}" in result.output, result.output


def test_an_existing_file_wins_over_the_preset_of_its_name(tmp_path, caplog):
    own = tmp_path / PRESET_FOLDER / "zero2.json"
    own.parent.mkdir()
    own.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    resolved, problems, notices = validated(tmp_path, caplog, deepspeed=f"{PRESET_FOLDER}/zero2.json")
    assert problems == [] and notices == []
    if resolved is not None:
        assert resolved == f"{PRESET_FOLDER}/zero2.json"
    cfg = validate_config(base_config(tmp_path)).model_copy(update={"deepspeed": f"{PRESET_FOLDER}/zero2.json"})
    assert use_deepspeed_preset(cfg) == (cfg, [])


@pytest.mark.parametrize("written", ["configs/zero2.json", "deepspeed_configs/zero4.json", "zero2.yml"])
def test_other_missing_paths_stay_an_error_that_lists_the_presets(tmp_path, caplog, written):
    resolved, problems, notices = validated(tmp_path, caplog, deepspeed=written)
    assert notices == [] and resolved is None
    assert len(problems) == 1
    assert problems[0].startswith(f"`deepspeed: {written}`: no such file.")
    for name in AXOLOTL_MEANING:
        assert f"`deepspeed_configs/{name}`" in problems[0]


@pytest.mark.parametrize("name", ["zero1_torch_compile.json", "zero2_torch_compile.json"])
def test_axolotls_compile_presets_say_what_to_use_instead(tmp_path, caplog, name):
    _, problems, notices = validated(tmp_path, caplog, deepspeed=f"deepspeed_configs/{name}")
    assert notices == [] and len(problems) == 1
    assert "hellbender has no preset of that name" in problems[0]
    assert f"`deepspeed: deepspeed_configs/{name.replace('_torch_compile', '')}`" in problems[0]
    assert "`torch_compile: true`" in problems[0]


def test_zero3_accepts_deepspeeds_newer_name_for_gathering_weights_on_save():
    newer = {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}}
    assert settings_problems("ds.json", newer) == []
    assert (
        "stage3_gather_16bit_weights_on_model_save"
        in settings_problems("ds.json", {"zero_optimization": {"stage": 3}})[0]
    )


def test_the_presets_are_package_data():
    section = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    patterns = re.findall(r'"([^"]+)"', section)
    root = REPO / "src" / "hellbender"
    shipped = {p for pattern in patterns for p in root.glob(pattern)}
    assert {preset_dir() / name for name in preset_names()} <= shipped
    assert preset_dir() == root / PRESET_FOLDER
