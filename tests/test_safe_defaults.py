"""Safe defaults: no remote code unless asked, and no unrestricted unpickling anywhere hellbender loads files."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.storage import manifest_run, write_manifest
from hellbender.train.run import train
from tests.helpers import base_config
from tests.test_checkpoints import finished_run  # noqa: F401 - the fixture

SOURCE = Path(__file__).resolve().parents[1] / "src" / "hellbender"


def test_trust_remote_code_is_off_unless_the_config_turns_it_on(tmp_path, monkeypatch):
    import transformers

    assert validate_config(base_config(tmp_path)).trust_remote_code is False
    seen: list[tuple[str, object]] = []

    def spy(name):
        original = getattr(transformers, name).from_pretrained

        def from_pretrained(*args, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code", "not passed")))
            return original(*args, **kwargs)

        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", from_pretrained)

    for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoProcessor"):
        spy(name)
    train(validate_config(base_config(tmp_path, max_steps=1)))
    assert {"AutoTokenizer", "AutoModelForCausalLM"} <= {name for name, _ in seen}
    assert all(value is False for _, value in seen), seen


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_no_unrestricted_unpickling_is_reachable_from_hellbender_code():
    """Every `torch.load` in hellbender passes `weights_only=True`; pickle and its relatives are never loaded."""
    forbidden = ("pickle.load", "pickle.loads", "dill.load", "dill.loads", "cloudpickle.load", "joblib.load")
    problems = []
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) > 40
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # `from pickle import load` and the like would hide a call from the check below
            if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "dill", "torch", "joblib"):
                problems += [f"{path.name}: from {node.module} import {a.name}" for a in node.names if "load" in a.name]
        for node, name in _calls(tree):
            where = f"{path.relative_to(SOURCE)}:{node.lineno}"
            keywords = {k.arg: k.value for k in node.keywords}
            if name.endswith("torch.load"):
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    problems.append(f"{where}: {name} without weights_only=True")
            if name in forbidden or name.endswith("read_pickle"):
                problems.append(f"{where}: {name}")
            if name.endswith("np.load") or name.endswith("numpy.load"):
                allow = keywords.get("allow_pickle")
                if isinstance(allow, ast.Constant) and allow.value:
                    problems.append(f"{where}: {name} with allow_pickle")
    assert problems == []


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_when_unpickled_is_refused_without_running_it(tmp_path, finished_run):  # noqa: F811
    out = tmp_path / "out"
    shutil.copytree(finished_run["output_dir"], out)
    marker = tmp_path / "code-ran"
    checkpoint = out / "checkpoint-4"
    run = manifest_run(checkpoint)  # the run that wrote it, so the checkpoint stays that run's
    torch.save({"python": _RunsCodeWhenUnpickled(marker)}, checkpoint / "rng_state.pth")
    write_manifest(checkpoint, run=run)  # complete by every file-level check: only the load itself can refuse it
    cfg = validate_config({**finished_run, "output_dir": str(out), "resume_from_checkpoint": str(checkpoint)})
    with pytest.raises(
        ConfigError, match=r"checkpoint-4 failed: one of its files holds Python objects .*Unsupported global"
    ):
        train(cfg)
    assert not marker.exists()


def test_background_loaders_are_the_default_only_for_prepared_images_on_a_gpu(tmp_path):
    from hellbender.config.defaults import dataloader_workers

    vlm = dict(
        base_model="hellbender/tiny-qwen2.5-vl",
        processor_type="AutoProcessor",
        datasets=[{"path": "data/vlm.jsonl", "type": "chat_template"}],
    )
    text = validate_config(base_config(tmp_path))
    images = validate_config(base_config(tmp_path, **vlm))
    assert dataloader_workers(text) == 0
    # This machine has no GPU: image rows stay in the training process too (workers pay off only beside a GPU).
    assert dataloader_workers(images) == (4 if torch.cuda.is_available() else 0)
    assert dataloader_workers(validate_config(base_config(tmp_path, dataloader_num_workers=2, **vlm))) == 2
    assert dataloader_workers(validate_config(base_config(tmp_path, dataloader_num_workers=0, **vlm))) == 0
