"""What hellbender writes to disk, and how a reader knows it is whole.

Every file and directory hellbender writes (the resolved config, checkpoints, the final model, a merged or
consolidated model, the prepared-data cache, the built-in tiny models, evaluation results) is either written whole
or not at all:
- a file is written beside its target and renamed over it (`write_file_atomically`);
- a directory is built under a staging name beside its target and renamed into place (`write_directory_atomically`);
- the final model shares `output_dir` with the checkpoints, so its files are moved in one by one
  (`move_files_into`), its manifest last;
- a checkpoint (written file by file by the Trainer) and a final model carry a manifest, written last, listing every
  file with its size and SHA-256, and the identity of the run that wrote it (`train/run_identity.py`). Sizes are
  checked whenever a directory is listed (`incompleteness`, cheap); the hashes when a directory is about to be used:
  resumed from, loaded for inference or merged (`content_mismatch`, one streamed read of every file).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hellbender.errors import EnvironmentProblem

CHECKPOINT_MANIFEST = "hellbender_checkpoint.json"  # in each complete `checkpoint-N`
FINAL_MANIFEST = "hellbender_model.json"  # beside a complete final, merged or consolidated model
MANIFEST_VERSION = 2  # 1: sizes only, no run identity (still read)
HASH = "sha256_chunks"  # see `file_digests`
CHUNK_BYTES = 64 * 1024**2
READ_BYTES = 4 * 1024**2
# Chunks are hashed on threads: hashlib releases the GIL while it hashes, so they run in parallel.
HASH_THREADS = min(8, os.cpu_count() or 1)
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


def write_errno(exc: OSError) -> int | None:
    """The errno of an OSError that is the machine's (disk full, read-only, permissions; `WRITE_ERRNOS`), or None.
    pyarrow and other writers report the errno only inside the message."""
    if exc.errno in WRITE_ERRNOS:
        return exc.errno
    return next((c for c in WRITE_ERRNOS if f"[errno {c}]" in str(exc).lower()), None)


def write_problem(path: Path, exc: OSError) -> EnvironmentProblem | None:
    """The user's paragraph for an OSError met while writing `path`, or None when the error is not the machine's."""
    code = write_errno(exc)
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


def move_files_into(staging: Path, target: Path, manifest: str = FINAL_MANIFEST, remove: Iterable[str] = ()) -> None:
    """Move everything in `staging` into the existing directory `target` (which holds other things too, such as
    checkpoints), `manifest` last; the old manifest goes first, so the old content is no longer trusted from the
    moment its files start to be replaced. `remove`: names in `target` that the new content supersedes (stale
    files of an earlier save), deleted before the new manifest arrives."""
    (target / manifest).unlink(missing_ok=True)
    for path in sorted(staging.iterdir(), key=lambda p: p.name == manifest):
        if path.name == manifest:
            for name in remove:
                stale = target / name
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink(missing_ok=True)
        if path.is_dir():
            shutil.rmtree(target / path.name, ignore_errors=True)
        os.replace(path, target / path.name)
    staging.rmdir()


def _chunk_digest(item: tuple[Path, int]) -> bytes:
    path, offset = item
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = CHUNK_BYTES
        while left > 0 and (block := f.read(min(READ_BYTES, left))):
            digest.update(block)
            left -= len(block)
    return digest.digest()


def file_digests(paths: list[Path]) -> list[str]:
    """Each file's digest: the SHA-256 of the SHA-256s of its `CHUNK_BYTES` chunks, read in a stream. Chunks,
    not files, are spread over the threads, so one big file (`optimizer.pt`) is hashed on every thread."""
    chunks = [(path, offset) for path in paths for offset in range(0, max(path.stat().st_size, 1), CHUNK_BYTES)]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(_chunk_digest, chunks))
    joined: dict[Path, Any] = {path: hashlib.sha256() for path in paths}
    for (path, _), digest in zip(chunks, digests, strict=True):
        joined[path].update(digest)
    return [joined[path].hexdigest() for path in paths]


def write_manifest(
    directory: Path, name: str = CHECKPOINT_MANIFEST, model_only: bool = False, run: dict[str, Any] | None = None
) -> None:
    """Record every file under `directory` (flushed to disk first) with its size and SHA-256, as the last write.
    `model_only`: a checkpoint written with `save_only_model` (no optimizer, scheduler or random state), which resume
    refuses. `run`: the identity of the run that wrote it (`RunIdentity.record()`)."""
    paths = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != name)
    for path in paths:
        fsync(path)
    digests = file_digests(paths)  # the files were just written: mostly read back from the page cache
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, HASH: digest}
        for path, digest in zip(paths, digests, strict=True)
    }
    manifest: dict = {"version": MANIFEST_VERSION, "files": files}
    if model_only:
        manifest["model_only"] = True
    if run is not None:
        manifest["run"] = run
    write_file_atomically(directory / name, json.dumps(manifest, indent=1))


def read_manifest(directory: Path, name: str = CHECKPOINT_MANIFEST) -> dict[str, Any] | None:
    """The manifest `name` of `directory`, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((directory / name).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def listed_files(directory: Path, name: str = CHECKPOINT_MANIFEST) -> set[str]:
    """The files the manifest `name` of `directory` lists (empty when there is none)."""
    manifest = read_manifest(directory, name)
    return set(manifest["files"]) if manifest else set()


def manifest_run(directory: Path, name: str = CHECKPOINT_MANIFEST) -> dict[str, Any] | None:
    """The identity of the run that wrote `directory`, or None for a manifest written before runs had one."""
    manifest = read_manifest(directory, name)
    run = manifest.get("run") if manifest else None
    return run if isinstance(run, dict) and isinstance(run.get("run_id"), str) else None


def is_model_only(directory: Path, name: str = CHECKPOINT_MANIFEST) -> bool:
    """The complete checkpoint `directory` holds the model only (written with `save_only_model`)."""
    return json.loads((directory / name).read_text()).get("model_only", False) is True


def _entry(value: Any) -> tuple[int, str | None]:
    """(size, SHA-256 or None) of one manifest entry: a plain size in version 1, a record in version 2."""
    if isinstance(value, dict):
        return int(value["size"]), value.get(HASH)
    return int(value), None


def incompleteness(directory: Path, name: str = CHECKPOINT_MANIFEST) -> str | None:
    """Why `directory` is not complete by its manifest `name` (files and sizes), or None when it is."""
    manifest = directory / name
    if not manifest.is_file():
        return f"it has no {name} (it was being written when the run stopped, or it is not a hellbender checkpoint)"
    try:
        files = {relative: _entry(value) for relative, value in json.loads(manifest.read_text())["files"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return f"its {name} is unreadable"
    for relative, (size, _) in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != size:
            return f"{relative} has {path.stat().st_size} bytes where the manifest says {size}"
    return None


def content_mismatch(directory: Path, name: str = CHECKPOINT_MANIFEST) -> str | None:
    """Why the files of the complete `directory` are not the ones its manifest recorded (a file changed or swapped
    after the save, by another run or by hand), or None when every hash matches. A version 1 manifest has no hashes
    and passes: `incompleteness` checked its sizes."""
    files = {relative: _entry(value) for relative, value in json.loads((directory / name).read_text())["files"].items()}
    hashed = [(relative, digest) for relative, (_, digest) in files.items() if digest is not None]
    found = file_digests([directory / relative for relative, _ in hashed])
    for (relative, digest), actual in zip(hashed, found, strict=True):
        if actual != digest:
            return f"{relative} is not the file that was saved (its hash differs from the one in {name})"
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
