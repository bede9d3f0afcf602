"""What hellbender writes to disk, and how a reader knows it is whole.

Every file and directory hellbender writes (the resolved config, checkpoints, the final model, a merged or
consolidated model, the prepared-data cache, the built-in tiny models, evaluation results) is either written whole
or not at all:
- a file is written beside its target and renamed over it (`write_file_atomically`);
- a directory is built under a staging name beside its target and renamed into place (`write_directory_atomically`);
- the final model shares `output_dir` with the checkpoints, so its files are moved in one by one
  (`move_files_into`), its manifest last;
- a checkpoint (written file by file by the Trainer) and a final model carry a manifest, written last, listing every
  file and its size; only a directory whose manifest is present and matches is trusted (`incompleteness`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hellbender.errors import EnvironmentProblem

CHECKPOINT_MANIFEST = "hellbender_checkpoint.json"  # in each complete `checkpoint-N`
FINAL_MANIFEST = "hellbender_model.json"  # beside a complete final, merged or consolidated model
MANIFEST_VERSION = 1
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Errors of the machine, not of hellbender: the user frees space, fixes permissions or points the path elsewhere.
WRITE_ERRNOS = {
    errno.ENOSPC: "free space on that disk, or point the run's directories (`output_dir`, `dataset_prepared_path`) at "
    "another one",
    errno.EDQUOT: "the disk quota is used up: free space, or point the run's directories at another disk",
    errno.EROFS: "the file system is read-only: point the run's directories (`output_dir`, `dataset_prepared_path`) at "
    "a writable one",
    errno.EACCES: "check the directory's permissions, or point the run's directories at one you can write",
    errno.EPERM: "check the directory's permissions, or point the run's directories at one you can write",
    errno.EFBIG: "the file is larger than this file system allows: point the run's directories at another one",
}


def write_problem(path: Path, exc: OSError) -> EnvironmentProblem | None:
    """The user's paragraph for an OSError met while writing `path`, or None when the error is not the machine's
    (disk full, read-only, permissions). pyarrow and other writers report the errno only inside the message."""
    code = exc.errno
    if code not in WRITE_ERRNOS:
        code = next((c for c in WRITE_ERRNOS if f"[errno {c}]" in str(exc).lower()), None)
    if code is None:
        return None
    return EnvironmentProblem(
        f"Could not write `{path}`: {os.strerror(code)}. Nothing was left half-written; {WRITE_ERRNOS[code]}."
    )


def _write_staging(staging: Path, text: str | bytes) -> None:
    """The one place a staged file's bytes are written (and flushed to the disk)."""
    with open(staging, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomically(path: Path, text: str | bytes) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never a part. A failed
    write (a full disk, a read-only directory) leaves neither the staged file nor a changed `path`."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_staging(staging, text)
        os.replace(staging, path)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        problem = write_problem(path, exc)
        if problem is None:
            raise
        raise problem from None


def make_directory(path: Path) -> None:
    """`mkdir -p path`, a full disk or read-only parent reported as the user's problem."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = write_problem(path, exc)
        if problem is None:
            raise
        raise problem from None


def can_write(directory: Path) -> bool:
    """Whether this process may create files in the existing `directory` (false on a read-only file system, even
    for root)."""
    return os.access(directory, os.W_OK | os.X_OK)


def write_directory_atomically(
    target: Path, write: Callable[[Path], None], keep_if: Callable[[Path], bool] | None = None
) -> Path:
    """Build the directory `target` with `write(staging)` under a staging name beside it, then rename it into place:
    a reader sees the old directory or the whole new one, and a kill leaves only a hidden staging directory that no
    reader trusts. An existing `target` is replaced whole, unless `keep_if(target)` says it is already complete
    (another process finished the same directory meanwhile)."""
    make_directory(target.parent)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    except OSError as exc:
        raise write_problem(target, exc) or exc from None
    try:
        write(staging)
        if keep_if is not None and keep_if(target):
            shutil.rmtree(staging)
        elif target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
            os.replace(target, old)  # moved aside first, so a kill leaves one of the two whole
            os.replace(staging, target)
            shutil.rmtree(old)
        else:
            os.replace(staging, target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        problem = write_problem(target, exc)
        if problem is None:
            raise
        raise problem from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def move_files_into(staging: Path, target: Path, manifest: str = FINAL_MANIFEST) -> None:
    """Move everything in `staging` into the existing directory `target` (which holds other things too, such as
    checkpoints), `manifest` last; the old manifest goes first, so the old content is no longer trusted from the
    moment its files start to be replaced."""
    (target / manifest).unlink(missing_ok=True)
    for path in sorted(staging.iterdir(), key=lambda p: p.name == manifest):
        if path.is_dir():
            shutil.rmtree(target / path.name, ignore_errors=True)
        os.replace(path, target / path.name)
    staging.rmdir()


def write_manifest(directory: Path, name: str = CHECKPOINT_MANIFEST, model_only: bool = False) -> None:
    """Record every file under `directory` (flushed to disk first) and its size, as the last write. `model_only`: a
    checkpoint written with `save_only_model` (no optimizer, scheduler or random state), which resume refuses."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != name):
        fsync(path)
        files[path.relative_to(directory).as_posix()] = path.stat().st_size
    manifest: dict = {"version": MANIFEST_VERSION, "files": files}
    if model_only:
        manifest["model_only"] = True
    write_file_atomically(directory / name, json.dumps(manifest, indent=1))


def is_model_only(directory: Path, name: str = CHECKPOINT_MANIFEST) -> bool:
    """The complete checkpoint `directory` holds the model only (written with `save_only_model`)."""
    return json.loads((directory / name).read_text()).get("model_only", False) is True


def incompleteness(directory: Path, name: str = CHECKPOINT_MANIFEST) -> str | None:
    """Why `directory` is not complete by its manifest `name`, or None when it is."""
    manifest = directory / name
    if not manifest.is_file():
        return f"it has no {name} (it was being written when the run stopped, or it is not a hellbender checkpoint)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"its {name} is unreadable"
    for relative, size in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != size:
            return f"{relative} has {path.stat().st_size} bytes where the manifest says {size}"
    return None


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-N` directory in `output_dir`, complete or not, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir()]
    return sorted(found)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    return [path for _, path in checkpoint_dirs(output_dir) if incompleteness(path) is None]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None
