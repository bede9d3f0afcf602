"""Errors of the operating system on the run's paths (a full disk, a read-only directory, an unreadable file) are
one paragraph naming the path, exit code 2, and leave nothing half-written.

A full disk cannot be made without root (a small tmpfs), and root reads every file whatever its mode, so these
errors are injected at hellbender's own seams: `storage._write_staging` (every staged file), `checks.can_write`,
and the module-level `open` of `data.sources`. Where the test runs as another user, the real permission cases run
too."""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hellbender.config.checks as checks
import hellbender.data.sources as sources
import hellbender.storage as storage
from hellbender.cli import app
from hellbender.data.images import ImagePolicy, ImageProblem, open_image, os_problem
from hellbender.errors import EnvironmentProblem
from tests.conftest import write_config, write_jsonl
from tests.helpers import assert_user_error

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")
AS_ROOT = os.geteuid() == 0

ROWS = [{"text": f"Document number {i} is about the sea."} for i in range(8)]


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def config_file(tmp_path: Path, **top) -> Path:
    write_jsonl(tmp_path / "data" / "text.jsonl", ROWS)
    config = {
        "base_model": "hellbender/tiny-llama",
        "datasets": [{"path": "data/text.jsonl", "type": "completion"}],
        "output_dir": "out",
        "dataset_prepared_path": "prepared",
        "sequence_len": 64,
        **top,
    }
    return write_config(tmp_path / "config.yml", json.dumps(config))


# ------------------------------------------------------------------------------------------------ the write seam


def test_a_full_disk_while_writing_a_file_leaves_the_old_file_and_no_staged_one(tmp_path, monkeypatch):
    target = tmp_path / "config.yml"
    target.write_text("old")

    def half_then_full(staging: Path, text: str) -> None:
        staging.write_text("half")
        disk_full()

    monkeypatch.setattr(storage, "_write_staging", half_then_full)
    with pytest.raises(EnvironmentProblem) as err:
        storage.write_file_atomically(target, "new")
    message = str(err.value)
    assert f"Could not write `{target}`: No space left on device" in message and "free space" in message
    assert target.read_text() == "old"
    assert files_under(tmp_path) == ["config.yml"]


def test_a_full_disk_while_building_a_directory_leaves_no_staging_directory(tmp_path):
    def write(staging: Path) -> None:
        (staging / "part-0.arrow").write_bytes(b"x" * 100)
        disk_full()

    with pytest.raises(EnvironmentProblem, match=r"Could not write `.*prepared/abc`: No space left on device"):
        storage.write_directory_atomically(tmp_path / "prepared" / "abc", write)
    assert list((tmp_path / "prepared").iterdir()) == []


def test_pyarrow_style_errors_name_their_errno_only_in_the_message():
    exc = OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert "No space left on device" in str(storage.write_problem(Path("x"), exc))
    assert storage.write_problem(Path("x"), OSError("something else")) is None  # not the machine's: re-raised


def test_preprocess_on_a_full_disk_is_one_paragraph_and_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_file(tmp_path)
    monkeypatch.setattr(storage, "_write_staging", disk_full)
    result = CliRunner().invoke(app, ["preprocess", str(config)])
    assert_user_error(result, "Could not write", "prepared", "No space left on device", "dataset_prepared_path")
    assert not (tmp_path / "prepared").exists() or files_under(tmp_path / "prepared") == []


def test_a_read_only_output_dir_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()
    config = config_file(tmp_path, output_dir="ro/run")
    monkeypatch.setattr(checks, "can_write", lambda directory: directory.resolve() != (tmp_path / "ro").resolve())
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert_user_error(result, "`output_dir: ro/run` cannot be written", "`ro` does not let this process create files")


@pytest.mark.skipif(AS_ROOT, reason="root may write into a directory of mode 0555")
def test_a_directory_without_write_permission_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir(mode=0o555)
    result = CliRunner().invoke(app, ["validate", str(config_file(tmp_path, dataset_prepared_path="ro/prepared"))])
    assert_user_error(result, "`dataset_prepared_path: ro/prepared` cannot be written")


# ------------------------------------------------------------------------------------------------ unreadable files


def test_an_unreadable_dataset_file_is_one_paragraph_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_file(tmp_path)

    def guarded_open(path, *args, **kwargs):
        if str(path).endswith("text.jsonl"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(sources, "open", guarded_open, raising=False)
    result = CliRunner().invoke(app, ["preprocess", str(config)])
    assert_user_error(result, "`data/text.jsonl` cannot be read (Permission denied)", "Check its permissions")
    assert not (tmp_path / "prepared").exists() or files_under(tmp_path / "prepared") == []


@pytest.mark.skipif(AS_ROOT, reason="root reads files of mode 0000")
def test_a_dataset_file_without_read_permission_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_file(tmp_path)
    (tmp_path / "data" / "text.jsonl").chmod(0)
    assert_user_error(CliRunner().invoke(app, ["preprocess", str(config)]), "cannot be read (Permission denied)")


def test_os_errors_on_images_name_the_image():
    assert str(os_problem("a.png", PermissionError(errno.EACCES, "Permission denied"))) == (
        "image `a.png` cannot be read: Permission denied"
    )
    assert "symlink loop" in str(os_problem("a.png", OSError(errno.ELOOP, "Too many levels of symbolic links")))
    assert "too long" in str(os_problem("a.png", OSError(errno.ENAMETOOLONG, "File name too long")))


@pytest.mark.skipif(AS_ROOT, reason="root reads files of mode 0000")
def test_an_image_without_read_permission_is_refused(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    (tmp_path / "a.png").chmod(0)
    with pytest.raises(ImageProblem, match="cannot be read: Permission denied"):
        open_image(tmp_path / "a.png", ImagePolicy(tmp_path, False, 10_000))


def test_a_full_disk_while_training_saves_a_checkpoint_is_one_paragraph_and_keeps_the_complete_one(
    tmp_path, monkeypatch
):
    """The Trainer's own writes (here the optimizer state of checkpoint-2) meet a full disk: exit 2 with one
    paragraph naming the file, the step and the newest complete checkpoint; the half-written checkpoint has no
    manifest, so it is never trusted, and the next start removes it."""
    import torch

    monkeypatch.chdir(tmp_path)
    config = config_file(tmp_path, max_steps=3, save_steps=1, micro_batch_size=2, learning_rate=1e-3)
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "checkpoint-2" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    result = CliRunner().invoke(app, ["train", str(config)])
    assert_user_error(
        result, "Training stopped at step 2", "checkpoint-2", "No space left on device", "`checkpoint-1` is the newest"
    )
    assert (tmp_path / "out" / "checkpoint-1" / storage.CHECKPOINT_MANIFEST).exists()
    assert not (tmp_path / "out" / "checkpoint-2" / storage.CHECKPOINT_MANIFEST).exists()
    assert [p.name for p in storage.complete_checkpoints(tmp_path / "out")] == ["checkpoint-1"]
