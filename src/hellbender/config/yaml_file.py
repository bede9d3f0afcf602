"""Reading a config file: YAML that is a mapping of keys, with errors that name the line and say how to fix it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hellbender.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key set twice in one mapping: plain YAML keeps the last value silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):  # other keys are refused by the base class, or are not config keys
                continue
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _line(lines: list[str], mark: Any) -> str:
    """The text of the line a YAML mark points at, for the error message."""
    if mark is None or not 0 <= mark.line < len(lines):
        return ""
    return f" (`{lines[mark.line].strip()}`)" if lines[mark.line].strip() else ""


def _yaml_hint(exc: yaml.YAMLError) -> str:
    text = f"{getattr(exc, 'context', '')} {getattr(exc, 'problem', '')}"
    if "'\\t'" in text:
        return "YAML does not allow tab characters for indentation; indent with spaces."
    if "another document" in text:
        return "A config is a single YAML document: remove the `---` line and keep one set of keys."
    if "mapping values are not allowed" in text:
        return (
            "Check the indentation of that line (keys of one mapping line up; a nested key is indented under its "
            "parent), and quote a value that holds `: `."
        )
    if "alias" in text:
        return "A `*name` refers to an `&name` anchor defined earlier; quote the value if it is text."
    if "tag" in text:
        return "Tags such as `!!python/...` are not allowed in a config; write plain values."
    return "Check the indentation, brackets and quotes around that line."


def _yaml_error(path: Path, lines: list[str], exc: yaml.YAMLError) -> ConfigError:
    problem = getattr(exc, "problem", None) or str(exc)
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}{_line(lines, mark)}" if mark else ""
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    # Where the unclosed quote / bracket / mapping started is often the line to fix, not where parsing stopped.
    started = ""
    if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
        started = f"; {context}, which starts at line {context_mark.line + 1}{_line(lines, context_mark)}"
    elif context:
        started = f" ({context})"
    return ConfigError(f"Config file `{path}` is not valid YAML: {problem}{where}{started}. {_yaml_hint(exc)}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".yml", ".yaml"))[:5]
        holds = f" (it holds {', '.join(inside)})" if inside else ""
        raise ConfigError(
            f"`{path}` is a directory; pass the path of the YAML file inside it that holds the config{holds}."
        )
    if not path.is_file():
        raise ConfigError(
            f"Config file `{path}` does not exist. Pass the path of a YAML config (see `hellbender examples`)."
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"Config file `{path}` is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); save it as UTF-8."
        ) from None
    lines = text.splitlines()
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as dup:
        raise ConfigError(
            f"Config file `{path}`: `{dup.key}` is set twice in the same mapping (lines {dup.first} and {dup.second}); "
            "YAML would silently keep only the last value. Keep one."
        ) from None
    except yaml.YAMLError as exc:
        raise _yaml_error(path, lines, exc) from None
    if data is None:
        return {}  # empty, or comments only: `load_config` says so unless overrides give the keys
    if isinstance(data, list):
        raise ConfigError(
            f"Config file `{path}` must be a YAML mapping of keys to values, not a list: remove the `- ` in front "
            "of the top-level keys (`base_model: ...`, not `- base_model: ...`)."
        )
    if not isinstance(data, dict):
        hint = (
            " (a key needs a space after the colon: `key: value`)"
            if isinstance(data, str) and ":" in data and ": " not in data
            else ""
        )
        raise ConfigError(
            f"Config file `{path}` must be a YAML mapping of keys to values, not the single value `{data}`{hint}; "
            "write one `key: value` per line, e.g. `base_model: ...`."
        )
    return data


def yaml_word(value: Any) -> str:
    """A scalar as a YAML file writes it (`true`, not Python's `True`), for messages that quote the user's value."""
    return str(value).lower() if isinstance(value, bool) else str(value)
