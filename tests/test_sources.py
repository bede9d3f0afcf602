"""Where rows come from: local files, directories, globs, other file formats, fsspec URLs and hub ids."""

from __future__ import annotations

import inspect
import json
import uuid

import datasets
import pandas as pd
import pytest

from hellbender.config import validate_config
from hellbender.data.sources import load_rows
from hellbender.errors import DataError
from tests.conftest import write_jsonl

ROWS = [{"text": "alpha", "n": 1}, {"text": "beta", "n": 2}, {"text": "gamma", "n": 3}]


def entry(**keys):
    return validate_config({"base_model": "hellbender/tiny-llama", "datasets": [keys]}).datasets[0]


def as_list(ds) -> list[dict]:
    return [dict(row) for row in ds]


def test_local_jsonl_file(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    ds = load_rows(entry(path=str(path)))
    assert isinstance(ds, datasets.Dataset)
    assert as_list(ds) == ROWS


def test_relative_path_from_the_current_directory(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    assert as_list(load_rows(entry(path="data.jsonl"))) == ROWS


def test_directory_loads_every_data_file_in_name_order(tmp_path):
    root = tmp_path / "corpus"
    write_jsonl(root / "b.jsonl", ROWS[1:2])
    write_jsonl(root / "a.jsonl", ROWS[:1])
    write_jsonl(root / "sub" / "c.jsonl", ROWS[2:])
    write_jsonl(root / ".hidden.jsonl", [{"text": "hidden", "n": 9}])
    (root / "README.md").write_text("not data")
    ds = load_rows(entry(path=str(root)))
    assert as_list(ds) == ROWS


def test_directory_skips_hidden_directories(tmp_path):
    """Hidden files are skipped, and so must be hidden directories: Jupyter's `.ipynb_checkpoints` holds stale
    copies of the data files, which would silently duplicate rows."""
    root = tmp_path / "corpus"
    write_jsonl(root / "a.jsonl", ROWS)
    write_jsonl(root / ".ipynb_checkpoints" / "a-checkpoint.jsonl", ROWS)
    assert as_list(load_rows(entry(path=str(root)))) == ROWS


def test_directory_with_data_files_loads_only_those(tmp_path):
    root = tmp_path / "corpus"
    write_jsonl(root / "a.jsonl", ROWS[:1])
    write_jsonl(root / "b.jsonl", ROWS[1:])
    ds = load_rows(entry(path=str(root), data_files=["b.jsonl"]))
    assert as_list(ds) == ROWS[1:]


def test_glob_loads_only_matching_files(tmp_path):
    write_jsonl(tmp_path / "part-0.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[2:])
    write_jsonl(tmp_path / "other.jsonl", [{"text": "other", "n": 0}])
    ds = load_rows(entry(path=str(tmp_path / "part-*.jsonl")))
    assert as_list(ds) == ROWS


def test_parquet_file(tmp_path):
    path = tmp_path / "data.parquet"
    pd.DataFrame(ROWS).to_parquet(path, index=False)
    assert as_list(load_rows(entry(path=str(path)))) == ROWS


def test_csv_file(tmp_path):
    path = tmp_path / "data.csv"
    pd.DataFrame(ROWS).to_csv(path, index=False)
    assert as_list(load_rows(entry(path=str(path)))) == ROWS


def test_ds_type_overrides_the_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # Without ds_type a .txt file is plain text: one `text` column holding each raw line.
    as_text = load_rows(entry(path=str(path)))
    assert as_text.column_names == ["text"]
    assert as_text[0]["text"] == json.dumps(ROWS[0])
    assert as_list(load_rows(entry(path=str(path), ds_type="json"))) == ROWS


def test_unknown_extension_without_ds_type_raises(tmp_path):
    path = tmp_path / "data.dat"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DataError, match=r"\.dat.*set `ds_type`"):
        load_rows(entry(path=str(path)))
    assert as_list(load_rows(entry(path=str(path), ds_type="jsonl"))) == ROWS[:1]


def test_fsspec_memory_url(monkeypatch):
    import fsspec

    # `datasets` refuses every URL in offline mode, even the in-process memory filesystem that needs no
    # network; allow it for this test only.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    fs = fsspec.filesystem("memory")
    url = f"memory://bucket-{uuid.uuid4().hex}/x.jsonl"
    with fs.open(url, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    try:
        ds = load_rows(entry(path=url))
        assert as_list(ds) == ROWS
    finally:
        fs.rm(url)


def test_fsspec_url_glob(monkeypatch):
    import fsspec

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    fs = fsspec.filesystem("memory")
    base = f"memory://bucket-{uuid.uuid4().hex}"
    for i, row in enumerate(ROWS):
        with fs.open(f"{base}/train/part-{i}.jsonl", "w") as f:
            f.write(json.dumps(row) + "\n")
    with fs.open(f"{base}/other/part-9.jsonl", "w") as f:
        f.write(json.dumps({"text": "other", "n": 9}) + "\n")
    try:
        ds = load_rows(entry(path=f"{base}/train/*.jsonl"))
        assert sorted(as_list(ds), key=lambda r: r["n"]) == ROWS
    finally:
        fs.rm(base, recursive=True)


def test_file_url(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    ds = load_rows(entry(path=path.as_uri()))
    assert path.as_uri().startswith("file://")
    assert as_list(ds) == ROWS


def test_hub_id_goes_through_load_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local `org/...` path can shadow the id
    signature = inspect.signature(datasets.load_dataset)
    calls = []
    fake = datasets.Dataset.from_list(ROWS)

    def fake_load_dataset(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)
        return fake

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_rows(entry(path="some-org/some-dataset", name="en", split="validation", revision="abc123"))
    assert ds is fake
    assert len(calls) == 1
    call = calls[0]
    assert call["path"] == "some-org/some-dataset"
    assert call["name"] == "en"
    assert call["split"] == "validation"
    assert call["revision"] == "abc123"
    assert call.get("streaming", False) is False


def test_hub_failure_raises_data_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def failing_load_dataset(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", failing_load_dataset)
    with pytest.raises(DataError, match=r"`some-org/missing` is not a local path.*offline"):
        load_rows(entry(path="some-org/missing"))


def test_missing_local_path_raises_data_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="no such file"):
        load_rows(entry(path=str(missing)))


def test_glob_without_matches_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_rows(entry(path=str(tmp_path / "*.jsonl")))


def test_split_on_local_files_raises_data_error(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(DataError, match="`split: test` applies to hub datasets"):
        load_rows(entry(path=str(path), split="test"))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n')
    with pytest.raises(DataError) as exc:
        load_rows(entry(path=str(path)))
    message = str(exc.value)
    assert str(path) in message
    assert "line 3" in message


def test_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"line 2 is not valid JSON \(expected an object"):
        load_rows(entry(path=str(path)))


def test_empty_jsonl_file_raises_data_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        load_rows(entry(path=str(path)))


def test_json_depth_counts_brackets_outside_strings_only():
    from hellbender.data.sources import json_depth

    assert json_depth('{"a": [1, {"b": "[[[{{{"}], "c": "\\"]"}') == 3
    assert json_depth("[" * 150 + "]" * 150) == 150


def test_deeply_nested_jsonl_rows_are_refused_by_line_and_row(tmp_path):
    from hellbender.data.sources import MAX_JSON_DEPTH, refuse_deep_json
    from hellbender.errors import DataError

    path = tmp_path / "rows.jsonl"
    shallow = '{"text": "' + "[" * 500 + '"}\n'  # brackets inside a string: not nesting
    deep = '{"x": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}\n"
    path.write_text(shallow + "\n" + shallow + deep)
    with pytest.raises(DataError, match=r"line 4 \(row 2\) nests arrays and objects more than 100 levels deep"):
        refuse_deep_json(str(path), "Dataset `rows.jsonl`")
    path.write_text(shallow + '{"x": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}\n")
    refuse_deep_json(str(path), "Dataset `rows.jsonl`")  # exactly the limit passes
