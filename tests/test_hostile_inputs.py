"""Property-based hostile inputs: random mutations of a valid config (`validate`) and of valid dataset rows
(`preprocess`), each run through the real CLI in-process. Whatever the input, the command must:

- exit 0 (the input happens to be fine) or 2 (one readable `error:` paragraph), never with an escaped exception;
- print no Python traceback;
- finish within `TIME_BOUND_S` (a SIGALRM timer turns a hang into a failure);
- write nothing outside the case's `output_dir` and `dataset_prepared_path` (those two keys are never mutated,
  so the allowed places stay fixed).

The starting points are `tests/helpers.base_config` and the bundled example rows; the case directory is built by
the helpers of tests/test_bad_inputs.py (its default files, then the mutated config or rows). CI runs a fixed,
derandomized set of examples; `HELLBENDER_FUZZ_EXAMPLES=2000` runs that many random examples per test instead.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import DatasetEntry, HellbenderConfig
from tests.conftest import EXAMPLES
from tests.helpers import base_config
from tests.test_bad_inputs import Case, build, image_bytes, snapshot  # noqa: F401  (image_bytes: a fixture)

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

# Examples per test: a fixed set in CI (about a minute for the module on 2 cores), or many random ones when asked.
SLOW_EXAMPLES = int(os.environ.get("HELLBENDER_FUZZ_EXAMPLES", "0") or 0)
CONFIG_EXAMPLES = SLOW_EXAMPLES or 500
ROW_EXAMPLES = SLOW_EXAMPLES or 150
TIME_BOUND_S = 30.0  # per example; generous for a slow CI machine, far below what a hang takes

FUZZ_SETTINGS = dict(
    derandomize=not SLOW_EXAMPLES,
    database=None,
    deadline=None,  # the time bound is checked by the test itself, with the same limit for every example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)

# Never mutated: they fix where a command may write.
PROTECTED = ("output_dir", "dataset_prepared_path")


# ---------------------------------------------------------------- hostile values

NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**63), 10**40, 1e308, -1e-308, 5e-324, math.inf, -math.inf, math.nan, 0.5]
# Cyrillic/full-width look-alikes, controls, lone surrogates, bidi and byte-order marks, paths that climb out.
STRINGS = [
    "",
    " ",
    "\0",
    "a\0b",
    "\ud800",
    "x\udfff",
    "\ufeffchat_template",
    "\u0441hat_template",  # Cyrillic es
    "ch\u0430t_template",  # Cyrillic a
    "\uff43hat_template",  # full-width c
    "\u202eetalpmet_tahc",
    "\n",
    "../../outside.jsonl",
    "/",
    "~",
    "${HOME}",
    "%s%n",
    "-1",
    ".inf",
    "null",
    "x" * 100_000,
    "\u00e9" * 20_000,
]
SCALARS = st.one_of(
    st.sampled_from(NUMBERS),
    st.sampled_from(STRINGS),
    st.booleans(),
    st.none(),
    st.integers(),
    st.floats(),
    st.text(st.characters(codec=None), max_size=12),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.sampled_from(["path", "type", "role", "content", "x", "\0"]), SCALARS, max_size=3),
)
CONFIG_KEYS = sorted(set(HellbenderConfig.model_fields) - set(PROTECTED))
ENTRY_KEYS = sorted(DatasetEntry.model_fields)
ROW_KEYS = ["messages", "role", "content", "instruction", "input", "output", "text", "conversations", "from", "value"]


def _homoglyph(key: Any) -> Any:
    if not isinstance(key, str) or not key:
        return key
    return key.replace("a", "\u0430", 1).replace("e", "\u0435", 1) if any(c in key for c in "ae") else key + "\u200b"


def _slots(tree: Any, protected: tuple[str, ...]) -> list[tuple[Any, Any]]:
    """(container, key or index) for every value under `tree` (shared values and cycles visited once)."""
    found, seen, todo = [], set(), [tree]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in list(items):
            if node is tree and key in protected:
                continue
            found.append((node, key))
            todo.append(value)
    return found


@st.composite
def mutated(draw, start: Any, keys: list[str], protected: tuple[str, ...] = (), cycles: bool = True) -> Any:
    """`start` after one to four structural mutations: a value replaced by a hostile one, a key deleted, renamed
    to a look-alike or added, a value nested deeper (sometimes past any sane depth), or one value shared by two
    places (YAML anchors and aliases), possibly one that contains itself (with `cycles`; JSON has no way to write
    one)."""
    tree = copy.deepcopy(start)
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(tree, protected)
        if not slots:
            break
        node, key = draw(st.sampled_from(slots))
        ops = ["replace", "replace", "delete", "rename", "add", "deepen", "share"] + ["cycle"] * cycles
        op = draw(st.sampled_from(ops))
        if op == "replace":
            node[key] = draw(VALUES)
        elif op == "delete":
            del node[key]
        elif op == "rename" and isinstance(node, dict):
            node[draw(st.sampled_from([_homoglyph(key), key.upper() if isinstance(key, str) else key, 3, None]))] = (
                node.pop(key)
            )
        elif op == "add":
            target = node[key] if isinstance(node[key], dict) else node if isinstance(node, dict) else tree
            if isinstance(target, dict):
                target[draw(st.sampled_from(keys))] = draw(VALUES)
            elif isinstance(target, list):
                target.append(draw(VALUES))
        elif op == "deepen":
            value = node[key]
            for _ in range(draw(st.sampled_from([1, 2, 5, 70, 300]))):
                value = draw(st.sampled_from([[value], {"x": value}]))
            node[key] = value
        elif op == "share":
            other, other_key = draw(st.sampled_from(slots))
            node[key] = other[other_key] if cycles else copy.deepcopy(other[other_key])  # a copy can't hold node
        elif op == "cycle" and isinstance(node[key], (list, dict)):
            inner = node[key]
            if isinstance(inner, list):
                inner.append(inner)
            else:
                inner[draw(st.sampled_from(keys))] = inner
    return tree


# ---------------------------------------------------------------- running a case


class Hung(BaseException):
    """Raised by the timer: a BaseException, so no `except Exception` in the code under test swallows it."""


def _on_alarm(signum, frame):
    raise Hung(f"no answer within {TIME_BOUND_S:g} s")


def run_case(root: Path, images: dict[str, bytes], case: Case) -> None:
    """Build `case` in a fresh `root`, run its command and check the properties of the module docstring."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    arena = root.parent
    cwd = os.getcwd()
    os.chdir(root)
    try:
        config = build(case, root, images)
        before = snapshot(arena)
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, TIME_BOUND_S)
        start = time.monotonic()
        try:
            result = CliRunner().invoke(app, [case.command, str(config)], env={"HELLBENDER_DEBUG": None})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        elapsed = time.monotonic() - start
        after = snapshot(arena)
    finally:
        os.chdir(cwd)
    event(f"{case.command}: exit {result.exit_code}")  # the mix shows with --hypothesis-show-statistics
    detail = f"exit {result.exit_code}, exception {result.exception!r}\n--- output:\n{result.output[-3000:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), detail
    assert result.exit_code in (0, 2), detail
    assert "Traceback" not in result.output, detail
    assert elapsed < TIME_BOUND_S, f"took {elapsed:.1f} s\n{detail}"
    allowed = tuple(f"{root.name}/{d}" for d in ("out", "prepared"))
    stray = sorted(
        p for p, size in after.items() if before.get(p) != size and not any(p.startswith(a + "/") for a in allowed)
    )
    assert not stray, f"wrote files outside output_dir / dataset_prepared_path: {stray}\n{detail}"


def _with_duplicate(text: str, line: str, indent: str) -> str:
    """YAML text with `line` (a key already present) written a second time, after the first line of its block."""
    lines = text.splitlines(keepends=True)
    at = next((i for i, t in enumerate(lines) if t.startswith("- ")), 0) if indent else 0
    return "".join(lines[: at + 1]) + indent + line + "".join(lines[at + 1 :])


@st.composite
def config_texts(draw) -> str:
    """A valid config's YAML (relative paths: the case directory is the current one), mutated as a tree and then
    as text: a duplicated key, a byte-order mark, a cut-off end, CRLF line ends."""
    valid = base_config(Path("."), datasets=[{"path": "data/chat.jsonl", "type": "chat_template"}])
    tree = draw(mutated(valid, CONFIG_KEYS + ENTRY_KEYS, PROTECTED))
    text = yaml.safe_dump(tree, sort_keys=False, allow_unicode=draw(st.booleans()), width=10**9)
    for op in draw(st.lists(st.sampled_from(["dup-top", "dup-entry", "bom", "cut", "crlf"]), max_size=2)):
        if op in ("dup-top", "dup-entry"):
            key = draw(st.sampled_from(CONFIG_KEYS if op == "dup-top" else ENTRY_KEYS))
            line = yaml.safe_dump({key: draw(VALUES)}, default_flow_style=None, width=10**9)
            text = _with_duplicate(text, line.splitlines()[0] + "\n", "  " if op == "dup-entry" else "")
        elif op == "bom":
            text = "\ufeff" + text
        elif op == "cut":
            text = text[: draw(st.integers(0, len(text)))]
        else:
            text = text.replace("\n", "\r\n")
    return text


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _rows(name: str, n: int = 4) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()[:n]]


FORMATS = {"chat_template": ("chat.jsonl", _rows("chat.jsonl")), "alpaca": ("alpaca.jsonl", _rows("alpaca.jsonl"))}


@st.composite
def row_files(draw) -> tuple[str, str]:
    """(dataset type, JSON-lines text): bundled rows of that format mutated as trees, then as text."""
    kind = draw(st.sampled_from(sorted(FORMATS)))
    rows = draw(mutated(FORMATS[kind][1], ROW_KEYS, cycles=False))
    ascii_only = draw(st.booleans())
    # A lone surrogate cannot be written as UTF-8: a row holding one keeps its `\\ud800` escape.
    lines = [json.dumps(r, ensure_ascii=ascii_only or not _encodable(json.dumps(r, ensure_ascii=False))) for r in rows]
    for op in draw(st.lists(st.sampled_from(["dup-key", "raw-nul", "bom", "cut", "blank", "not-json"]), max_size=2)):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if op == "dup-key" and lines[i].startswith("{") and len(lines[i]) > 2:
            key = draw(st.sampled_from(ROW_KEYS))
            lines[i] = "{" + json.dumps(key) + ": " + json.dumps(draw(VALUES)) + ", " + lines[i][1:]
        elif op == "raw-nul":
            lines[i] = lines[i].replace('"', '"\0', 1)
        elif op == "bom":
            lines[0] = "\ufeff" + lines[0]
        elif op == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif op == "blank":
            lines.insert(i, "")
        else:
            lines.insert(i, draw(st.sampled_from(["[1, 2]", "null", "42", '"text"', "{", "}"])))
    return kind, "".join(line + "\n" for line in lines)


def _root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "case"


# ---------------------------------------------------------------- the properties


def test_validate_survives_hostile_configs(tmp_path_factory, image_bytes):  # noqa: F811
    root = _root(tmp_path_factory)

    @settings(max_examples=CONFIG_EXAMPLES, **FUZZ_SETTINGS)
    @given(text=config_texts())
    def check(text: str) -> None:
        run_case(root, image_bytes, Case(id="hostile-config", command="validate", expect=[], config_text=text))

    check()


def test_preprocess_survives_hostile_rows(tmp_path_factory, image_bytes):  # noqa: F811
    root = _root(tmp_path_factory)

    @settings(max_examples=ROW_EXAMPLES, **FUZZ_SETTINGS)
    @given(data=row_files())
    def check(data: tuple[str, str]) -> None:
        kind, text = data
        name = FORMATS[kind][0]
        config = base_config(Path("."), datasets=[{"path": f"data/{name}", "type": kind}])
        case = Case(id="hostile-rows", command="preprocess", expect=[], config=config, base="none")
        case.files = {f"data/{name}": text}
        run_case(root, image_bytes, case)

    check()
