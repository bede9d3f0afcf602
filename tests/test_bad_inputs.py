"""A corpus of bad inputs, each refused with exit code 2, one readable paragraph and nothing half-written.

Most cases are hand-written in `tests/bad_inputs/cases.yaml` (its header describes the format); families that
follow one rule for many keys (a wrong type for every scalar key, a misspelling of every key) are generated
below, each with its own expected text. Every case runs the real CLI in-process (`validate` for config
errors, `preprocess` for data errors, `train` only where the error can only appear there) and checks:

- exit code 2, no traceback, an `error:` paragraph on stderr holding every expected substring;
- nothing written: no file under the case's directory is added or changed (no checkpoint, no model file, no
  prepared-data cache entry, no staging directory left behind by the atomic cache writer); an empty directory
  created on the way is allowed.
"""

from __future__ import annotations

import copy
import io
import json
import random
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.config.spellings import ZERO_MEANS_UNSET
from hellbender.data.cache import COMPLETE_MARKER
from hellbender.data.formats import render_budget

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

CASES_FILE = Path(__file__).parent / "bad_inputs" / "cases.yaml"
COMMANDS = ("validate", "preprocess", "train")
SMALL_PIXELS = 2000  # `max_image_pixels` of the image bases: 32x32 (1024) passes, 64x64 (4096) does not

CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus 1?"}, {"role": "assistant", "content": f"{i + 1}."}]}
    for i in range(8)
]
TEXT_ROWS = [{"text": f"Document number {i} is about the sea."} for i in range(8)]
ALPACA_ROWS = [{"instruction": f"Add one to {i}.", "input": "", "output": f"{i + 1}"} for i in range(8)]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def vlm_row(*images: str, question: str = "What colour is it?", answer: str = "Red.") -> dict:
    parts = [{"type": "image", "path": p} for p in images] + [{"type": "text", "text": question}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


# Files every case starts with (relative to the case's directory, which is also the current directory).
DEFAULT_FILES: dict[str, Any] = {
    "data/chat.jsonl": CHAT_ROWS,
    "data/text.jsonl": TEXT_ROWS,
    "data/alpaca.jsonl": ALPACA_ROWS,
    "data/images/red.png": {"image": "red"},
    "data/images/green.png": {"image": "green"},
    "data/vlm.jsonl": [vlm_row("images/red.png"), vlm_row("images/green.png", answer="Green.")],
    "data/cpt.jsonl": [{"text": f"{QWEN_IMAGE}A red square.", "images": ["images/red.png"]}],
    "outside.png": {"image": "red"},
    "outside.jsonl": TEXT_ROWS,
}

# Configs a case's `config:` is merged onto (top-level keys replace the base's).
COMMON = {"output_dir": "out", "dataset_prepared_path": "prepared", "sequence_len": 64}
BASES: dict[str, dict[str, Any]] = {
    "none": {},
    "text": {
        "base_model": "hellbender/tiny-llama",
        **COMMON,
        "datasets": [{"path": "data/chat.jsonl", "type": "chat_template"}],
    },
    "vlm": {
        "base_model": "hellbender/tiny-qwen2.5-vl",
        "processor_type": "AutoProcessor",
        **COMMON,
        "sequence_len": 256,
        "max_image_pixels": SMALL_PIXELS,
        "datasets": [{"path": "data/vlm.jsonl", "type": "chat_template"}],
    },
    "gemma": {
        "base_model": "hellbender/tiny-gemma4-vlm",
        "processor_type": "AutoProcessor",
        **COMMON,
        "sequence_len": 512,
        "max_image_pixels": SMALL_PIXELS,
        "datasets": [{"path": "data/vlm.jsonl", "type": "chat_template"}],
    },
}


@dataclass
class Case:
    id: str
    command: str
    expect: list[str]
    base: str = "text"
    config: dict[str, Any] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)
    config_text: str | None = None  # the config file's raw text (malformed YAML); `config` is then unused
    config_path: str = "config.yml"  # the path given on the command line
    files: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    remote: dict[str, Any] = field(default_factory=dict)  # URL -> body spec, answered by a fake fetcher


def load_cases() -> list[Case]:
    return [Case(**entry) for entry in yaml.safe_load(CASES_FILE.read_text())]


# ---------------------------------------------------------------- generated families


def _base(annotation: Any) -> Any:
    """The type under a shared value type (`Int` is an annotated `int`)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _annotations(annotation: Any) -> list[Any]:
    """The members of a field's annotation (itself when it is not a union), shared value types included."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _scalar_kind(annotation: Any) -> tuple[str, tuple[Any, ...]]:
    """('int' | 'float' | 'bool' | 'literal' | 'other', literal values) of a field's annotation, ignoring None."""
    args = [_base(a) for a in typing.get_args(annotation) if a is not type(None)] or [_base(annotation)]
    literals = tuple(v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a))
    plain = [a for a in args if typing.get_origin(a) is not typing.Literal]
    if literals and plain in ([], [bool]):
        return "literal", literals + ((True, False) if plain else ())
    if plain == [bool]:
        return "bool", ()
    if plain == [int]:
        return "int", ()
    if plain == [float]:
        return "float", ()
    return "other", ()


WRONG_VALUE = {"int": "many", "float": "lots", "bool": "sometimes", "literal": "bogus-choice"}
# What pydantic says each kind should be, which the message must carry so the user knows what to write.
WRONG_WORDS = {"int": "integer", "float": "number", "bool": "valid boolean"}


def wrong_type_cases() -> list[Case]:
    """A wrong value for every scalar key of the config and of a dataset entry."""
    cases = []
    for key, info in HellbenderConfig.model_fields.items():
        kind, literals = _scalar_kind(info.annotation)
        if kind == "other":
            continue
        value = WRONG_VALUE[kind]
        words = [WRONG_WORDS[kind]] if kind != "literal" else [_shown(v).strip("'") for v in literals]
        cases.append(
            Case(
                id=f"gen-wrong-type-{key}",
                command="validate",
                config={key: value},
                expect=[f"`{key}`", f"'{value}'", *words],
            )
        )
    for key, info in DatasetEntry.model_fields.items():
        kind, literals = _scalar_kind(info.annotation)
        if kind == "other":
            continue
        value = WRONG_VALUE[kind]
        words = [WRONG_WORDS[kind]] if kind != "literal" else [_shown(v).strip("'") for v in literals]
        cases.append(
            Case(
                id=f"gen-wrong-type-datasets-{key}",
                command="validate",
                config={"datasets": [{"path": "data/chat.jsonl", "type": "chat_template", key: value}]},
                expect=[f"`datasets.0.{key}`", f"'{value}'", *words],
            )
        )
    return cases


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else f"'{value}'"


def _entry_config(key: str, value: Any) -> dict[str, Any]:
    return {"datasets": [{"path": "data/chat.jsonl", "type": "chat_template", key: value}]}


def _keys_of(kinds: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(key as the error names it, its kind, its name) for each top-level and dataset-entry key that holds a number
    (`int`, `float`) or a name or path (`name`, `path`: the shared `Name` and `PathText` types) of one of `kinds`."""
    found = []
    for prefix, fields in (("", HellbenderConfig.model_fields), ("datasets.0.", DatasetEntry.model_fields)):
        for key, info in fields.items():
            members = _annotations(info.annotation)
            # pydantic keeps a bare field's `Annotated` metadata on the field, and a union member's in the member
            typed = [(info.annotation, info.metadata)] if len(members) == 1 and members[0] is info.annotation else []
            typed += [(_base(m), typing.get_args(m)[1:]) for m in members if typing.get_origin(m) is typing.Annotated]
            typed += [(m, ()) for m in members if typing.get_origin(m) is not typing.Annotated]
            for base, metadata in typed:
                kind = _value_kind(base, metadata)
                if kind in kinds:
                    # a list of numbers: its first item carries the value (lists of names take a lone name too)
                    item = ".0" if typing.get_origin(base) is list and kind in ("int", "float") else ""
                    found.append((f"{prefix}{key}{item}", kind, key))
                    break
    return found


def _value_kind(base: Any, metadata: Any) -> str | None:
    validators = {getattr(getattr(m, "func", None), "__name__", "") for m in metadata}
    if base in (int, float) and validators & {"check", "_a_finite_number"}:  # the shared `Int` / `Float`
        return base.__name__
    if base is str:
        return "path" if "_a_path" in validators else "name" if "_a_name" in validators else None
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        return (
            _value_kind(_base(item), typing.get_args(item)[1:]) if typing.get_origin(item) is typing.Annotated else None
        )
    return None


def _set(shown_key: str, key: str, value: Any) -> dict[str, Any]:
    if shown_key.endswith(f"{key}.0"):  # a list key: the value is its only item
        value = [value]
    return _entry_config(key, value) if shown_key.startswith("datasets.") else {key: value}


def boolean_number_cases() -> list[Case]:
    """`true` for every number key: pydantic's lax mode would read it as 1."""
    return [
        Case(
            id=f"gen-boolean-for-number-{shown}",
            command="validate",
            config=_set(shown, key, True),
            expect=[f"`{shown}`", "not true", "booleans"],
        )
        for shown, kind, key in _keys_of(("int", "float"))
        if kind in ("int", "float")
    ]


def non_finite_cases() -> list[Case]:
    """`.inf` and `.nan` for every float key."""
    cases = []
    for shown, _, key in _keys_of(("float",)):
        for value, word in ((float("inf"), "inf"), (float("nan"), "nan")):
            cases.append(
                Case(
                    id=f"gen-{word}-{shown}",
                    command="validate",
                    config=_set(shown, key, value),
                    expect=[f"`{shown}` must be a finite number", f"(got {word})"],
                )
            )
    return cases


# Keys whose empty value Axolotl configs write for "off" (`deepspeed: ""`), read as unset.
EMPTY_MEANS_UNSET = ("deepspeed",)


def empty_text_cases() -> list[Case]:
    """An empty value and a NUL byte for every path and name key (a list of names gets them as an item)."""
    cases = []
    for shown, _kind, key in _keys_of(("path", "name")):
        info = (DatasetEntry if shown.startswith("datasets.") else HellbenderConfig).model_fields[key]
        only_a_list = all(typing.get_origin(m) is list for m in _annotations(info.annotation))
        for value, label, words in (("", "empty", ["empty"]), ("a\0b", "nul", ["NUL byte"])):
            if not value and key in EMPTY_MEANS_UNSET:
                continue
            cases.append(
                Case(
                    id=f"gen-{label}-{shown}",
                    command="validate",
                    config=_set(shown, key, [value] if only_a_list else value),
                    expect=[f"`{shown}{'.0' if only_a_list else ''}`", *words],
                )
            )
    return cases


def out_of_range_cases() -> list[Case]:
    """A value just outside the bounds of every bounded numeric key."""
    cases = []
    for key, info in HellbenderConfig.model_fields.items():
        for bound in info.metadata:
            for attr, word, delta in (
                ("gt", "greater than", 0),
                ("ge", "greater than or equal to", -1),
                ("lt", "less than", 0),
            ):
                limit = getattr(bound, attr, None)
                if limit is None:
                    continue
                # 0 reads as unset for a few per-epoch counts (as in Axolotl): the value past it is -1
                bad = -1 if key in ZERO_MEANS_UNSET and attr == "gt" else limit + delta
                cases.append(
                    Case(
                        id=f"gen-out-of-range-{key}-{attr}",
                        command="validate",
                        config={key: bad},
                        expect=[f"`{key}`", f"{word} {limit:g}", f"(got {bad})"],
                    )
                )
    return cases


def _typo(key: str) -> str:
    """A realistic slip: two neighbouring letters swapped after the first third of the name."""
    i = max(1, len(key) // 3)
    while i < len(key) - 1 and (key[i] == key[i + 1] or "_" in key[i : i + 2]):
        i += 1
    return key[:i] + key[i + 1] + key[i] + key[i + 2 :] if i < len(key) - 1 else key + key[-1]


def misspelled_key_cases() -> list[Case]:
    """Every key of the config and of a dataset entry, misspelled: the message names the slip and the key."""
    cases = []
    for key in HellbenderConfig.model_fields:
        if len(key) < 5:
            continue
        typo = _typo(key)
        cases.append(
            Case(
                id=f"gen-misspelled-{key}",
                command="validate",
                config={typo: 1},
                expect=[f"`{typo}` is not a config key", f"Did you mean `{key}`?"],
            )
        )
    for key in DatasetEntry.model_fields:
        if len(key) < 5:
            continue
        typo = _typo(key)
        cases.append(
            Case(
                id=f"gen-misspelled-datasets-{key}",
                command="validate",
                config={"datasets": [{"path": "data/chat.jsonl", "type": "chat_template", typo: 1}]},
                expect=["In `datasets[0]`", f"`{typo}` is not a config key", f"Did you mean `{key}`?"],
            )
        )
    return cases


HAND_WRITTEN = load_cases()
GENERATED = (
    wrong_type_cases()
    + out_of_range_cases()
    + misspelled_key_cases()
    + boolean_number_cases()
    + non_finite_cases()
    + empty_text_cases()
)
ALL_CASES = HAND_WRITTEN + GENERATED


def test_corpus_is_large_and_ids_are_unique():
    ids = [c.id for c in ALL_CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert len(HAND_WRITTEN) >= 120 and len(ALL_CASES) >= 200, (len(HAND_WRITTEN), len(ALL_CASES))
    for case in ALL_CASES:
        assert case.command in COMMANDS, case.id
        assert case.base in BASES, case.id
        assert case.expect, case.id


# ---------------------------------------------------------------- building a case


@pytest.fixture(scope="session")
def image_bytes() -> dict[str, bytes]:
    """Image files by kind, built once: good PNGs, one too large, and broken files of several kinds."""
    from PIL import Image

    def encode(img: Image.Image, fmt: str = "PNG") -> bytes:
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        return buf.getvalue()

    import numpy as np

    rng = random.Random(0)
    noisy = Image.frombytes("RGB", (32, 32), rng.randbytes(32 * 32 * 3))  # noise: pixel data fills most of the file
    png, jpeg = encode(noisy), encode(noisy, "JPEG")
    return {
        "red": encode(Image.new("RGB", (32, 32), (200, 30, 30))),
        "green": encode(Image.new("RGB", (32, 32), (30, 200, 30))),
        "big": encode(Image.new("RGB", (64, 64), (30, 30, 200))),
        "truncated": png[: len(png) // 2],
        "truncated_jpeg": jpeg[: len(jpeg) // 2],
        "header_only": png[:16],
        "not_image": b"this is a text file, not an image\n",
        "random": rng.randbytes(400),
        "empty": b"",
        # float pixels from 0 to 1000: neither a [0, 1] nor a [0, 255] image, so no scale to 8 bits is known
        "float_wide": encode(Image.fromarray(np.linspace(0, 1000, 64, dtype=np.float32).reshape(8, 8), "F"), "TIFF"),
    }


def write_file(path: Path, spec: Any, images: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, list):  # dataset rows, one JSON object a line
        path.write_text("".join(json.dumps(row) + "\n" for row in spec))
    elif isinstance(spec, str):  # raw text, written as is
        path.write_text(spec)
    elif "image" in spec:
        path.write_bytes(images[spec["image"]])
    elif "dir" in spec:
        path.mkdir(parents=True, exist_ok=True)
    elif "symlink" in spec:
        path.symlink_to(spec["symlink"])
    elif "bytes" in spec:  # text with bytes that are not UTF-8, written as latin-1
        path.write_bytes(spec["bytes"].encode("latin-1"))
    else:
        raise AssertionError(f"unknown file spec {spec!r}")


def config_for(case: Case, root: Path) -> dict[str, Any]:
    config = copy.deepcopy(BASES[case.base])
    for key in case.unset:
        config.pop(key, None)
    config.update(copy.deepcopy(case.config))
    return _with_root(config, root)


def _with_root(value: Any, root: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{root}", str(root))
    if isinstance(value, list):
        return [_with_root(v, root) for v in value]
    if isinstance(value, dict):
        return {k: _with_root(v, root) for k, v in value.items()}
    return value


def build(case: Case, root: Path, images: dict[str, bytes]) -> Path:
    for name, spec in {**DEFAULT_FILES, **case.files}.items():
        if spec is None:  # a case removes a default file
            continue
        write_file(root / name, _with_root(spec, root), images)
    config = root / case.config_path
    if case.config_path == "config.yml":
        text = case.config_text
        if text is None:
            text = yaml.safe_dump(config_for(case, root), sort_keys=False)
        config.write_text(text)
    return config


def fake_fetch(remote: dict[str, Any], images: dict[str, bytes]):
    """A stand-in for `remote_images.fetch` serving the case's bodies; any other URL fails to connect."""
    import urllib.error

    from hellbender.data.remote_images import FetchedBody

    def fetch(url: str) -> FetchedBody:
        if url not in remote:
            raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
        spec = remote[url]
        body = images[spec["image"]] if "image" in spec else spec["text"].encode()
        announced = None if spec.get("no_length") else len(body)
        if spec.get("cut"):
            body = body[: len(body) // 2]
        default_type = "image/png" if "image" in spec else "text/html; charset=utf-8"
        return FetchedBody(body, spec.get("content_type", default_type), announced)

    return fetch


def snapshot(root: Path) -> dict[str, int]:
    """Every file under `root` (symlinks not followed) with its size: a failed command must add or change none."""
    return {str(p.relative_to(root)): p.lstat().st_size for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}


# ---------------------------------------------------------------- the test


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_bad_input_is_refused_clearly(case: Case, tmp_path: Path, monkeypatch, image_bytes):
    monkeypatch.delenv("HELLBENDER_DEBUG", raising=False)
    # A template that never ends is refused when its render budget runs out: 2 seconds here instead of 10, so the
    # two such cases do not spend 20 seconds of the suite waiting (rendering a conversation takes milliseconds).
    monkeypatch.setattr(render_budget, "RENDER_SECONDS", 2.0)
    root = tmp_path / "case"
    root.mkdir()
    monkeypatch.chdir(root)
    config = build(case, root, image_bytes)
    if case.remote:
        import hellbender.data.remote_images as remote_images

        monkeypatch.setattr(remote_images, "fetch", fake_fetch(case.remote, image_bytes))
    before = snapshot(root)
    checkpoints_before = set(root.rglob("checkpoint-*"))
    markers_before = set(root.rglob(COMPLETE_MARKER))

    result = CliRunner().invoke(app, [case.command, str(config), *case.args])

    detail = f"exit {result.exit_code}, exception {result.exception!r}\n--- output:\n{result.output}"
    assert result.exit_code == 2, detail
    assert isinstance(result.exception, SystemExit), detail  # not an exception that escaped the CLI
    assert "Traceback" not in result.output, detail
    # Progress bars may share stderr; the error paragraph is what follows the last line that starts with `error:`.
    starts = [m.start() for m in re.finditer(r"(?m)^error: ", result.stderr)]
    assert starts, detail
    message = result.stderr[starts[-1] :]
    for needle in case.expect:
        needle = needle.replace("{root}", str(root))
        assert needle in message, f"{needle!r} not in the error:\n{message}"

    after = snapshot(root)
    assert set(root.rglob("checkpoint-*")) <= checkpoints_before, "a checkpoint was written"
    assert set(root.rglob(COMPLETE_MARKER)) <= markers_before, "a prepared-data cache entry was completed"
    assert not list(root.rglob(".tmp-*")), "a prepared-data staging directory was left behind"
    assert after == before, f"the failed command wrote files: {sorted(set(after.items()) - set(before.items()))}"
