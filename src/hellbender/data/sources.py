"""Where rows come from: local files, directories and globs; fsspec URLs; hub dataset ids.

Everything is loaded through `datasets`, so rows are Arrow-backed and memory-mapped. The kind of source is
decided by the path alone: an existing local path or glob, a URL with a scheme (`s3://`, `gs://`, `az://`,
`file://`, ...), or else a hub id.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from hellbender.errors import DataError

EXTENSION_TO_BUILDER = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}
DS_TYPE_TO_BUILDER = {
    "json": "json",
    "jsonl": "json",
    "parquet": "parquet",
    "csv": "csv",
    "text": "text",
    "arrow": "arrow",
}


def is_url(path: str) -> bool:
    return "://" in path


def local_files(path: str) -> list[str]:
    """The data files a local path names: the file itself, the files of a directory, or a glob's matches."""
    p = Path(path).expanduser()
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        # Hidden files and directories (.git, .ipynb_checkpoints, ...) are never data.
        return sorted(
            str(f)
            for f in p.rglob("*")
            if f.is_file()
            and f.suffix in EXTENSION_TO_BUILDER
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
    return sorted(f for f in glob.glob(str(p), recursive=True) if os.path.isfile(f))


def looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or any(ch in path for ch in "*?[") or Path(path).expanduser().exists()


def builder_for(files: list[str], ds_type: str | None, where: str) -> str:
    if ds_type:
        return DS_TYPE_TO_BUILDER[ds_type]
    suffixes = {Path(f.split("?")[0]).suffix for f in files}
    builders = {EXTENSION_TO_BUILDER.get(s) for s in suffixes}
    if len(builders) != 1 or None in builders:
        raise DataError(
            f"{where}: cannot tell the file format from the extension(s) {', '.join(sorted(suffixes)) or '(none)'}; "
            "set `ds_type` (json, jsonl, parquet, csv, text or arrow)."
        )
    return builders.pop()


def load_rows(entry: Any, streaming: bool = False):
    """Load the rows of one dataset entry as a `datasets.Dataset` (or `IterableDataset` when streaming)."""
    import datasets

    where = f"Dataset `{entry.path}`"
    path = entry.path
    if is_url(path):
        files = [path] if entry.data_files is None else _as_list(entry.data_files)
        builder = builder_for(files, entry.ds_type, where)
        kwargs = dict(data_files=files)  # fsspec finds credentials in the usual environment variables
    elif looks_local(path):
        files = _local_data_files(entry)
        if not files:
            raise DataError(
                f"{where}: no such file, directory or matching files. Check `path` (relative paths start from the current directory)."
            )
        if all(os.path.getsize(f) == 0 for f in files):
            raise DataError(f"{where} has no rows: {', '.join(files[:3])} {'is' if len(files) == 1 else 'are'} empty.")
        builder = builder_for(files, entry.ds_type, where)
        kwargs = dict(data_files=files)
    else:
        return _load_hub(entry, streaming, where)
    if entry.split != "train":
        raise DataError(
            f"{where}: `split: {entry.split}` applies to hub datasets; local files form one split. Remove `split`."
        )
    try:
        ds = datasets.load_dataset(builder, split="train", streaming=streaming, **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, StopIteration) as exc:
        raise DataError(_describe_load_failure(where, builder, files, exc)) from None
    return ds


def _local_data_files(entry: Any) -> list[str]:
    if entry.data_files is None:
        return local_files(entry.path)
    base = Path(entry.path).expanduser()
    return [f for pattern in _as_list(entry.data_files) for f in local_files(str(base / pattern))]


def _load_hub(entry: Any, streaming: bool, where: str):
    import datasets

    try:
        return datasets.load_dataset(
            entry.path,
            name=entry.name,
            split=entry.split,
            data_files=entry.data_files,
            revision=entry.revision,
            streaming=streaming,
        )
    except Exception as exc:  # the hub client raises many types: offline, missing repo, missing split...
        raise DataError(
            f"{where} is not a local path and could not be loaded as a hub dataset: {str(exc).rstrip('.')}. Check the id, `split`, "
            "network access and credentials (HF_TOKEN), or point `path` at local files."
        ) from None


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _describe_load_failure(where: str, builder: str, files: list[str], exc: Exception) -> str:
    if builder == "json":
        for f in files:
            bad = first_bad_json_line(f)
            if bad is not None:
                line, err = bad
                return (
                    f"{where}: `{f}` line {line} is not valid JSON ({err}). Fix or remove that line; each line of a "
                    "JSONL file must be one JSON object."
                )
    cause = exc.__cause__ or exc
    return f"{where}: could not read the {builder} file(s) {', '.join(files[:3])}: {cause}"


def first_bad_json_line(path: str) -> tuple[int, str] | None:
    """Line number and reason of the first line of a JSONL file that is not a JSON object (None if all are)."""
    if is_url(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1).lstrip()
        f.seek(0)
        if head == "[":  # a JSON array file, not JSONL
            try:
                json.load(f)
            except json.JSONDecodeError as exc:
                return exc.lineno, exc.msg
            return None
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                return number, exc.msg
            if not isinstance(value, dict):
                return number, f"expected an object, got {type(value).__name__}"
    return None
