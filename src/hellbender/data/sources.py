"""Where rows come from: local files, directories and globs; fsspec URLs; hub dataset ids.

Everything is loaded through `datasets`, so rows are Arrow-backed and memory-mapped. The kind of source is
decided by the path alone: an existing local path or glob, a URL with a scheme (`s3://`, `gs://`, `az://`,
`file://`, ...), or else a hub id.
"""

from __future__ import annotations

import glob
import json
import os
import re
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
# Deeper JSON crashes the loaders (Python's recursion limit in `datasets`, a stack overflow in Arrow's reader); real
# rows (tool arguments, JSON schemas) nest a few levels.
MAX_JSON_DEPTH = 100
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


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
    """A path that names local files: it exists, starts like a path, is a glob, or ends in a data file's extension
    (`data/train.jsonl` is a missing file, not a hub id)."""
    return (
        path.startswith((".", "/", "~"))
        or any(ch in path for ch in "*?[")
        or Path(path).expanduser().exists()
        or Path(path).suffix in EXTENSION_TO_BUILDER
    )


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


def load_rows(entry: Any, streaming: bool = False, where: str | None = None):
    """Load the rows of one dataset entry as a `datasets.Dataset` (or `IterableDataset` when streaming).

    `where` names the entry in error messages (default: its path)."""
    import datasets

    where = where or f"Dataset `{entry.path}`"
    path = entry.path
    if is_url(path):
        files = [path] if entry.data_files is None else _as_list(entry.data_files)
        builder = builder_for(files, entry.ds_type, where)
        kwargs = dict(data_files=files)  # fsspec finds credentials in the usual environment variables
    elif looks_local(path):
        files = local_data_files(entry, where)
        if not files:
            if Path(path).expanduser().is_dir():
                raise DataError(
                    f"{where}: the directory `{path}` holds no data files "
                    f"({', '.join(sorted(set(EXTENSION_TO_BUILDER)))}; hidden files are skipped). Put the data files "
                    "in it, point `path` at the files themselves, or name them with `data_files`."
                )
            if Path(path).expanduser().is_symlink():
                raise DataError(
                    f"{where}: `{path}` is a symlink that leads nowhere (a symlink loop, or its target is missing). "
                    "Point `path` at the data file itself."
                )
            raise DataError(
                f"{where}: no such file, directory or matching files. Check `path` (relative paths start from the "
                "current directory)."
            )
        for f in files:
            if (reason := unreadable(f)) is not None:
                raise DataError(f"{where}: `{f}` cannot be read ({reason}). Check its permissions, or remove it.")
        if all(os.path.getsize(f) == 0 for f in files):
            raise DataError(f"{where} has no rows: {', '.join(files[:3])} {'is' if len(files) == 1 else 'are'} empty.")
        builder = builder_for(files, entry.ds_type, where)
        kwargs = dict(data_files=files)
        if builder == "json":
            for f in files:
                refuse_deep_json(f, where)
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


def unreadable(path: str) -> str | None:
    """Why this process cannot read the local file `path` (permissions, an I/O error), or None."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def stream_rows(entry: Any, where: str, seed: int, shuffle_buffer: int | None):
    """The rows of `entry`, read lazily. With `shuffle_buffer`, shuffled with `seed`: the order of the files, and
    the rows through a buffer of that many (each row read leaves the buffer at a random place), so a pass is
    the same for the same seed, and a resumed run replays it exactly."""
    rows = load_rows(entry, streaming=True, where=where)
    return rows.shuffle(seed=seed, buffer_size=shuffle_buffer) if shuffle_buffer else rows


def local_data_files(entry: Any, where: str) -> list[str]:
    """The files of a local dataset entry: `path` itself, or the `data_files` patterns inside the directory `path`.

    A `data_files` pattern may not leave `path` (`../other.jsonl`, an absolute path elsewhere): an entry reads
    what its directory holds, nothing beside it. The check is on the written pattern, so a data directory made
    of symlinks (as the hub cache is) still works."""
    if entry.data_files is None:
        return local_files(entry.path)
    base = Path(entry.path).expanduser()
    root = Path(os.path.normpath(base.absolute()))
    files = []
    for pattern in _as_list(entry.data_files):
        target = Path(os.path.normpath(root / Path(pattern).expanduser()))
        if not target.is_relative_to(root):
            raise DataError(
                f"{where}: `data_files` entry `{pattern}` points outside the dataset directory `{entry.path}` (to "
                f"`{target}`). `data_files` names files inside `path`: point `path` at the directory that holds them, "
                "or add a separate dataset entry for them."
            )
        matched = local_files(str(target))
        if not matched and base.is_dir():
            raise DataError(
                f"{where}: `data_files` entry `{pattern}` matches no file in `{entry.path}`. Check the name; it is "
                "relative to `path`."
            )
        files += matched
    return files


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
                kind = (
                    "the file must be one JSON array of objects"
                    if "JSON array" in err
                    else ("each line of a JSONL file must be one JSON object")
                )
                return f"{where}: `{f}` line {line} is not valid JSON ({err}). Fix or remove that line; {kind}."
    cause = exc.__cause__ or exc
    if "corresponds to no data" in str(exc):  # what `datasets` says when the files hold no rows
        return (
            f"{where} has no rows: {', '.join(files[:3])} {'holds' if len(files) == 1 else 'hold'} none (blank "
            "lines, an empty JSON array, or a CSV with only its header). Add rows, or remove the dataset entry."
        )
    return (
        f"{where}: could not read the {builder} file(s) {', '.join(files[:3])}: {str(cause).strip().rstrip('.')}. "
        f"Check that the file holds {builder} data, or set `ds_type` to the format it holds."
    )


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text` (brackets inside strings do not count)."""
    depth = deepest = 0
    for token in _JSON_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in "]}":
            depth -= 1
    return deepest


def refuse_deep_json(path: str, where: str) -> None:
    """Refuse a JSON / JSONL file with a row nested deeper than MAX_JSON_DEPTH, or a JSONL line that is `null`,
    naming the line, before the loaders crash on it (pyarrow's JSON reader ends the process with a segmentation fault
    on a leading `null` line). A line with fewer brackets than the limit is passed over without a scan."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1).lstrip()
        f.seek(0)
        if head == "[":  # one JSON array: its rows sit one level down
            if json_depth(f.read()) > MAX_JSON_DEPTH + 1:
                raise DataError(_too_deep(where, path, "a row of it"))
            return
        row = 0
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if line.strip() == "null":
                raise DataError(
                    f"{where}: `{path}` line {number} is not valid JSON (expected an object, got null). Fix or remove "
                    "that line; each line of a JSONL file must be one JSON object."
                )
            if line.count("[") + line.count("{") > MAX_JSON_DEPTH and json_depth(line) > MAX_JSON_DEPTH:
                raise DataError(_too_deep(where, path, f"line {number} (row {row})"))
            row += 1


def _too_deep(where: str, path: str, what: str) -> str:
    return (
        f"{where}: `{path}` {what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep, which the JSON "
        "loaders cannot read (they crash on it). Flatten that value, store it as a JSON string, or remove the row."
    )


def first_bad_json_line(path: str) -> tuple[int, str] | None:
    """Line number and reason of the first line of a JSONL file that is not a JSON object (None if all are)."""
    if is_url(path):
        return None
    bad_text = first_non_utf8_line(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1).lstrip()
        f.seek(0)
        if head == "[":  # a JSON array file, not JSONL
            try:
                json.load(f)
            except json.JSONDecodeError as exc:
                return exc.lineno, f"{exc.msg}; the file is one JSON array, so the mistake may be just before it"
            return bad_text
        for number, line in enumerate(f, start=1):
            if bad_text is not None and number == bad_text[0]:
                return bad_text
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                return number, _json_reason(exc, line)
            if not isinstance(value, dict):
                return number, f"expected an object, got {type(value).__name__}"
    return None


def _json_reason(exc: json.JSONDecodeError, line: str) -> str:
    if exc.msg.startswith("Expecting property name enclosed in double quotes") and "'" in line:
        return f"{exc.msg}: JSON strings and keys use double quotes, not single quotes"
    return exc.msg


def first_non_utf8_line(path: str) -> tuple[int, str] | None:
    """Line number and reason of the first line of a local text file that is not UTF-8 (None if all are)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
    return None
