"""`hellbender validate` prints exactly what runs: every value the code decides is decided at validation, so no key of
a validated config is left null unless `UNSET_MEANS` says what null means for it; the keys that depend on the
machine show what they will be on this one."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import dump_config, load_config, validate_config
from hellbender.config.defaults import (
    ENTRY_UNSET_MEANS,
    KEYS_FILLED_FOR_TYPE,
    UNSET_MEANS,
    VISION_TYPES,
    machine_defaults,
)
from hellbender.config.machine import Machine
from hellbender.config.rl import ONLINE_RL_METHODS
from tests.conftest import EXAMPLES
from tests.helpers import base_config

EXAMPLE_CONFIGS = sorted(EXAMPLES.glob("*.yml"))
ENTRY_LISTS = ("datasets", "test_datasets", "pretraining_dataset")
CPU = Machine(cuda=False, bf16=False, cpus=2)
GPU = Machine(cuda=True, bf16=True, cpus=16)


def null_keys(node, path: str = "") -> list[str]:
    """Dotted paths of every null value in a dumped config."""
    if isinstance(node, dict):
        return [
            p for key, value in node.items() for p in null_keys(value, f"{path}{key}" if not path else f"{path}.{key}")
        ]
    if isinstance(node, list):
        return [p for i, value in enumerate(node) for p in null_keys(value, f"{path}.{i}")]
    return [path] if node is None else []


@pytest.mark.parametrize("example", EXAMPLE_CONFIGS, ids=lambda p: p.stem)
def test_every_null_of_a_validated_example_has_a_stated_meaning(example, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)  # examples name their data relative to the project root
    cfg = load_config(example)
    dumped = yaml.safe_load(dump_config(cfg))
    unexplained = [
        path
        for path in null_keys(dumped)
        if path.split(".")[-1] not in (ENTRY_UNSET_MEANS if path.split(".")[0] in ENTRY_LISTS else UNSET_MEANS)
    ]
    assert unexplained == []
    assert dumped["warmup_steps"] is not None or dumped["warmup_ratio"] is not None
    for key in ("datasets", "test_datasets"):
        for i, entry in enumerate(dumped[key]):
            # A user's prompt transform (`type: module.function`, online RL) has no keys of hellbender's to fill.
            user_transform = cfg.rl in ONLINE_RL_METHODS and entry["type"] not in KEYS_FILLED_FOR_TYPE
            filled = () if user_transform else KEYS_FILLED_FOR_TYPE[entry["type"]]
            assert [k for k in filled if entry[k] is None] == [], f"{key}.{i}"
            if cfg.is_multimodal and entry["type"] in VISION_TYPES:
                assert entry["image_base_dir"] is not None


def test_the_examples_cover_every_dataset_type_that_fills_keys():
    """Otherwise the test above would not see whether each type's keys get filled."""
    types = set()
    for example in EXAMPLE_CONFIGS:
        raw = yaml.safe_load(example.read_text())
        types |= {entry.get("type") or "pretokenized" for entry in raw.get("datasets", [])}
        types |= {
            "completion" for entry in raw.get("pretraining_dataset", []) if entry.get("type") != "multimodal_pretrain"
        }
    assert {"chat_template", "alpaca", "completion"} <= types


def test_dataset_entry_defaults_come_from_the_top_level_keys(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, train_on_inputs=True, chat_template="chatml")
        | {
            "datasets": [
                {
                    "path": str(tmp_path / "a.jsonl"),
                    "type": "chat_template",
                    "message_property_mappings": {"role": "from"},
                }
            ]
        }
    )
    (entry,) = cfg.datasets
    assert entry.train_on_inputs is True
    assert entry.chat_template == "chatml"
    assert entry.message_property_mappings == {"role": "from", "content": "content"}
    assert entry.roles_to_train == ["assistant"] and entry.train_on_eos == "turn"


def test_completion_field_becomes_the_one_text_column_key(tmp_path):
    cfg = validate_config(
        base_config(tmp_path)
        | {"datasets": [{"path": str(tmp_path / "a.jsonl"), "type": "completion", "field": "body"}]}
    )
    assert (cfg.datasets[0].text_column, cfg.datasets[0].field) == ("body", None)


def test_a_dumped_config_validates_again_to_the_same_config(tmp_path):
    """The resolved config written beside each run (and printed by validate) is itself a valid config."""
    cfg = validate_config(base_config(tmp_path, adapter="lora", warmup_ratio=0.1))
    again = validate_config(yaml.safe_load(dump_config(cfg)))
    assert again.model_dump() == cfg.model_dump()


def test_machine_dependent_defaults_are_decided_by_the_machine(tmp_path):
    text = validate_config(base_config(tmp_path, bf16="auto"))
    images = validate_config(
        base_config(tmp_path, processor_type="AutoProcessor", base_model="hellbender/tiny-qwen2.5-vl", bf16="auto")
    )
    assert machine_defaults(text, CPU) == {"bf16": "fp32", "optimizer": "adamw_torch", "dataloader_num_workers": 0}
    assert machine_defaults(text, GPU) == {
        "bf16": "bf16",
        "optimizer": "adamw_torch_fused",
        "dataloader_num_workers": 0,
    }
    assert machine_defaults(images, GPU)["dataloader_num_workers"] == 4
    chosen = validate_config(base_config(tmp_path, optimizer="sgd", bf16=False, dataloader_num_workers=2))
    assert machine_defaults(chosen, GPU) == {"bf16": "fp32", "optimizer": "sgd", "dataloader_num_workers": 2}


def test_validate_says_what_the_machine_decides(tmp_path):
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, bf16="auto")))
    result = CliRunner().invoke(app, ["validate", str(config), "--print"])
    assert result.exit_code == 0, result.output
    lines = {line.partition(":")[0]: line for line in result.output.splitlines()}
    assert lines["bf16"] == "bf16: auto  # on this machine (no CUDA GPU): fp32"
    assert lines["optimizer"] == "optimizer: auto  # on this machine (no CUDA GPU): adamw_torch"
    assert lines["dataloader_num_workers"].startswith("dataloader_num_workers: auto  # on this machine")
