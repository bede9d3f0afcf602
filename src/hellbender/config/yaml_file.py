"""Reading a config file: YAML that is a mapping of keys, with errors that name the line and say how to fix it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from hellbender.errors import ConfigError

logger = logging.getLogger("hellbender")


MERGE_TAG = "tag:yaml.org,2002:merge"
# Far beyond any real config (the deepest Axolotl example nests 5 levels and holds a few hundred values), and small
# enough that a file of anchors and aliases cannot expand into millions of values for later steps to walk.
MAX_DEPTH = 64
MAX_VALUES = 100_000
MAX_FILE_BYTES = 1 << 20


class _ConfigLoader(yaml.SafeLoader):
    """A safe loader that refuses a key set twice in one mapping (plain YAML keeps the last value silently) and a
    key that is not text (YAML 1.1 reads an unquoted `on:` or `yes:` as a boolean), and notes each key that replaces
    a different value merged in with `<<:`."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.notices: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        explicit: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (list, dict)):
                continue  # the base class refuses it as unhashable, with YAML's own message
            if not isinstance(key, str):
                raise _KeyNotText(key, line)
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key], explicit[key] = line, value_node
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG:
                self._note_replaced_merges(value_node, explicit, seen)
        return super().construct_mapping(node, deep=deep)

    def _note_replaced_merges(self, merged: yaml.Node, explicit: dict[str, yaml.Node], lines: dict[str, int]) -> None:
        sources = merged.value if isinstance(merged, yaml.SequenceNode) else [merged]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                continue  # the base class refuses it with YAML's own message
            values = self.construct_object(source, deep=True)
            for key in values.keys() & explicit.keys():
                mine = self.construct_object(explicit[key], deep=True)
                if mine != values[key]:
                    self.notices.append(
                        f"`{key}: {yaml_word(mine)}` on line {lines[key]} replaces `{key}: {yaml_word(values[key])}`, "
                        f"merged in with `<<:` from line {source.start_mark.line + 1}."
                    )


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


class _KeyNotText(Exception):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(key)
        self.key, self.line = key, line


class _TooLarge(Exception):
    def __init__(self, line: int, why: str, fix: str) -> None:
        super().__init__(why)
        self.line, self.why, self.fix = line, why, fix


_FLATTEN = "a config nests a few levels at most; check the brackets"
_WRITE_OUT = "a config is a few hundred values at most; write the values out, or fix the alias that repeats them"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "a null"
    return "a number" if isinstance(value, (int, float)) else "a date"


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_size(root: yaml.Node) -> None:
    """Refuse a document that nests deeper than MAX_DEPTH or holds more than MAX_VALUES values once its aliases are
    expanded, or that contains itself. Aliases share nodes, so each node is measured once (no expansion here)."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) when expanded
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            ancestors.discard(id(node))
            kids = [measured[id(kid)] for kid in _children(node)]
            values, depth = 1 + sum(v for v, _ in kids), 1 + max((d for _, d in kids), default=0)
            line = node.start_mark.line + 1
            if depth > MAX_DEPTH:
                raise _TooLarge(line, f"it nests more than {MAX_DEPTH} levels deep", _FLATTEN)
            if values > MAX_VALUES:
                raise _TooLarge(line, f"its anchors and aliases expand to more than {MAX_VALUES:,} values", _WRITE_OUT)
            measured[id(node)] = (values, depth)
        elif id(node) in ancestors:
            raise _TooLarge(
                node.start_mark.line + 1, "an alias refers to a value that contains it", "write the value out instead"
            )
        elif id(node) not in measured:
            ancestors.add(id(node))
            stack.append((node, True))
            stack.extend((kid, False) for kid in _children(node))


def load_yaml_text(text: str) -> tuple[Any, list[str]]:
    """The value of a one-document YAML text, and notices about it; raises yaml.YAMLError or one of this module's
    exceptions (which `read_yaml` and `yaml_value` turn into messages)."""
    loader = _ConfigLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # the composer recurses once per nesting level
            raise _TooLarge(1, f"it nests more than {MAX_DEPTH} levels deep", _FLATTEN) from None
        if node is None:
            return None, []
        _check_size(node)
        return loader.construct_document(node), loader.notices
    finally:
        loader.dispose()


def yaml_value(text: str, where: str) -> Any:
    """A value written on the command line (`--set key=VALUE`), read as the config file's values are."""
    try:
        value, notices = load_yaml_text(text)
    except _TooLarge as big:
        raise ConfigError(f"{where}: the value is refused: {big.why}; {big.fix}.") from None
    except (yaml.YAMLError, _DuplicateKey, _KeyNotText):
        raise ConfigError(f"{where}: the value is not valid YAML for a config; quote it if it is text.") from None
    for notice in notices:
        logger.warning(f"{where}: {notice}")
    return value


class _Mark(NamedTuple):
    """A 1-based line number in the shape of a YAML mark (0-based `line`), for `_line`."""

    number: int

    @property
    def line(self) -> int:
        return self.number - 1


def _line(lines: list[str], mark: Any) -> str:
    """The text of the line a YAML mark points at, for the error message."""
    if mark is None or not 0 <= mark.line < len(lines):
        return ""
    text = lines[mark.line].strip()
    return f" (`{text if len(text) <= 80 else text[:77] + '...'}`)" if text else ""


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
    if path.exists() and not path.is_file():
        raise ConfigError(
            f"Config file `{path}` is not a regular file (a device, pipe or socket); pass the path of a YAML file."
        )
    if not path.is_file():
        raise ConfigError(
            f"Config file `{path}` does not exist. Pass the path of a YAML config (see `hellbender examples`)."
        )
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError(
            f"Config file `{path}` is {path.stat().st_size:,} bytes; a config is a few kilobytes (the limit is "
            f"{MAX_FILE_BYTES:,}). Check that the path names the config and not a data file."
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
        data, notices = load_yaml_text(text)
    except _DuplicateKey as dup:
        raise ConfigError(
            f"Config file `{path}`: `{dup.key}` is set twice in the same mapping (lines {dup.first} and {dup.second}); "
            "YAML would silently keep only the last value. Keep one."
        ) from None
    except _KeyNotText as bad:
        raise ConfigError(
            f"Config file `{path}`: the key on line {bad.line}{_line(lines, _Mark(bad.line))} is read as "
            f"{_kind(bad.key)} (`{yaml_word(bad.key)}`), not as a name: YAML reads an unquoted `on`, `off`, `yes`, "
            '`no`, `y`, `n`, `null`, `~`, a number or a date that way. Quote the key (`"on": ...`) if it is a name.'
        ) from None
    except _TooLarge as big:
        raise ConfigError(
            f"Config file `{path}` is refused: {big.why} (from line {big.line}{_line(lines, _Mark(big.line))}); "
            f"{big.fix}."
        ) from None
    except yaml.YAMLError as exc:
        raise _yaml_error(path, lines, exc) from None
    for notice in notices:
        logger.warning(f"Config file `{path}`: {notice}")
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
