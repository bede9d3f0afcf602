"""Reading a YAML config: overrides, unknown and not-yet-supported keys, type errors, conflicts, defaults."""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hellbender.config.checks import find_conflicts, find_path_problems
from hellbender.config.defaults import apply_derived_defaults
from hellbender.config.schema import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry
from hellbender.errors import ConfigError

# Where each list of entries is validated by which model, for key checks inside entries.
ENTRY_MODELS: dict[str, type[BaseModel]] = {
    "datasets": DatasetEntry,
    "test_datasets": DatasetEntry,
    "pretraining_dataset": PretrainingDatasetEntry,
}


@cache
def _axolotl_keys(filename: str) -> frozenset[str]:
    text = resources.files("hellbender.config").joinpath(filename).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


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


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set key=value` overrides. Values are parsed as YAML; dotted keys reach into lists and mappings
    (`datasets.0.path=data.jsonl`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"Override `{item}` is not of the form KEY=VALUE (e.g. `--set learning_rate=1e-4`).")
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            raise ConfigError(f"Override `{item}`: the value is not valid YAML; quote it if it is text.") from None
        parts = key.split(".")
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            nxt = _child(node, part, item)
            if nxt is None:
                nxt = {}
                _assign(node, part, nxt, item)
            node = nxt
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"Override `{item}`: `{'.'.join(parts[: depth + 1])}` is not a mapping or list.")
        _assign(node, parts[-1], value, item)
    return raw


def _child(node: Any, part: str, item: str) -> Any:
    if isinstance(node, list):
        index = _index(node, part, item)
        return node[index]
    return node.get(part)


def _assign(node: Any, part: str, value: Any, item: str) -> None:
    if isinstance(node, list):
        node[_index(node, part, item)] = value
    else:
        node[part] = value


def _index(node: list, part: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"Override `{item}`: `{part}` is not an index of a list with {len(node)} entries.")
    return int(part)


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _check_keys(raw: dict[str, Any], model: type[BaseModel], axolotl_keys: frozenset[str], where: str) -> list[str]:
    """Unknown keys get a did-you-mean; keys Axolotl defines that we do not implement are refused by name.

    An unimplemented key set to an empty or false value asks for nothing, so it is accepted (configs
    written for Axolotl often carry `load_in_8bit: false` and the like)."""
    problems = []
    known = set(model.model_fields)
    for key in list(raw):
        if key in known:
            continue
        if key in axolotl_keys:
            if _is_unset(raw[key]):
                del raw[key]
                continue
            problems.append(
                f"{where}`{key}` is not supported yet: hellbender does not implement it, and ignoring it would "
                f"silently change your run. Remove it, or set it to false / null if you do not need it."
            )
            continue
        misplaced = _misplaced(key, model)
        if misplaced:
            problems.append(f"{where}{misplaced}")
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6) or difflib.get_close_matches(
            key, sorted(axolotl_keys), n=1, cutoff=0.6
        )
        hint = f" Did you mean `{close[0]}`?" if close else " See `hellbender schema` or docs/config.md for every key."
        problems.append(f"{where}`{key}` is not a config key.{hint}")
    return problems


def _misplaced(key: str, model: type[BaseModel]) -> str | None:
    """A key written at the wrong level: a dataset-entry key at the top (an entry's indentation lost) or a top-level
    key inside an entry."""
    if model is HellbenderConfig and key in DatasetEntry.model_fields:
        layout = "`- path: ...`" if key == "path" else f"`- path: ...` then `  {key}: ...`"
        return (
            f"`{key}` is not a top-level key: it is a key of a dataset entry. Indent it under the entry of "
            f"`datasets:` it belongs to ({layout})."
        )
    if model is not HellbenderConfig and key in HellbenderConfig.model_fields:
        return f"`{key}` is a top-level key, not a key of a dataset entry: move it out of the dataset entry."
    return None


_MISSING = object()
# List keys whose items are dataset entries: a wrong item gets a hint on how an entry is written.
_ENTRY_LIST_HINT = ", each starting with `- path: ...` and its other keys indented below"


def _split_loc(loc: tuple[Any, ...], raw: Any) -> tuple[tuple[Any, ...], str | None]:
    """The key path the user wrote, and the union member pydantic named after it, if any.

    pydantic puts the member of a union type (`bool`, `literal['auto']`, `list[str]`) into the error location;
    a location part that is not in the user's data at that point is such a member."""
    node: Any = raw
    for i, part in enumerate(loc):
        in_mapping = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_mapping or in_list):
            return tuple(loc[:i]), str(part)
        node = node[part]
    return tuple(loc), None


def _value_at(raw: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        raw = raw[part]
    return raw


def _describe_member(tag: str) -> str:
    """What a union member accepts, in YAML words: `bool` is true or false, `literal['a','b']` is 'a' or 'b'."""
    simple = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "text"}
    if tag in simple:
        return simple[tag]
    inner = tag[tag.find("[") + 1 : -1] if tag.endswith("]") else ""
    if tag.startswith("literal["):
        values = [v.strip() for v in inner.split(",")]
        return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"
    if tag.startswith("list["):
        return f"a list of {_describe_member(inner)}"
    if tag.startswith("tuple["):
        return f"a pair [{inner.replace('int', 'integer')}]"
    if tag.startswith("dict["):
        return "a mapping of keys to values"
    return tag


def _field_description(path: tuple[Any, ...]) -> str:
    if len(path) == 1 and path[0] in HellbenderConfig.model_fields:
        return HellbenderConfig.model_fields[path[0]].description or ""
    if len(path) == 3 and path[0] in ENTRY_MODELS and path[2] in ENTRY_MODELS[path[0]].model_fields:
        return ENTRY_MODELS[path[0]].model_fields[path[2]].description or ""
    return ""


def _shown(value: Any) -> str:
    return "nothing" if value is _MISSING else "a mapping" if isinstance(value, dict) else repr(value)


def _plain_message(err: dict[str, Any], path: tuple[Any, ...]) -> str:
    """pydantic's message, in YAML words where it speaks Python (a dictionary, an instance of a model)."""
    if err["type"] == "list_type" and len(path) == 1 and path[0] in ENTRY_MODELS:
        return f"must be a list of entries{_ENTRY_LIST_HINT}"
    if err["type"] in ("model_type", "model_attributes_type") and len(path) == 2 and path[0] in ENTRY_MODELS:
        return f"must be a mapping of keys to values: `{path[0]}` is a list of entries{_ENTRY_LIST_HINT}"
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return "Input should be a mapping of keys to values (`key: value` lines)"
    return err["msg"].rstrip(".")


def _format_validation_error(exc: ValidationError, raw: dict[str, Any]) -> list[str]:
    """One paragraph per wrong key: the key path as `--set` writes it (`datasets.0.type`), what it accepts and the
    value it got. The errors pydantic gives for each member of a union type are merged into one."""
    groups: dict[tuple[Any, ...], list[tuple[str | None, dict[str, Any]]]] = {}
    for err in exc.errors():
        if err["type"] == "missing":
            path, member = tuple(err["loc"]), None
        else:
            path, member = _split_loc(err["loc"], raw)
        groups.setdefault(path, []).append((member, err))
    problems = []
    for path, errs in groups.items():
        loc = ".".join(str(p) for p in path)
        members = list(dict.fromkeys(m for m, _ in errs if m is not None))
        if errs[0][1]["type"] == "missing":
            description = _field_description(path).rstrip(".")
            problems.append(f"`{loc}` is required but missing" + (f": {description}." if description else "."))
        elif members:
            try:
                value = _value_at(raw, path)
            except (KeyError, IndexError, TypeError):
                value = _MISSING
            accepted = ", or ".join(_describe_member(m) for m in members)
            problems.append(f"`{loc}` must be {accepted} (got {_shown(value)}).")
        else:
            for _, err in errs:
                msg = _plain_message(err, path)
                colon = "" if msg.startswith("must") else ":"
                problems.append(f"`{loc}`{colon} {msg} (got {_shown(err.get('input'))}).")
    return problems


def validate_config(raw: dict[str, Any]) -> HellbenderConfig:
    problems = _check_keys(raw, HellbenderConfig, _axolotl_keys("axolotl_keys.txt"), "")
    for list_key, model in ENTRY_MODELS.items():
        entries = raw.get(list_key)
        if isinstance(entries, dict):  # Axolotl accepts a single mapping for pretraining_dataset
            entries = raw[list_key] = [entries]
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    where = f"In `{list_key}[{i}]`: "
                    problems += _check_keys(entry, model, _axolotl_keys("axolotl_dataset_keys.txt"), where)
    if problems:
        raise ConfigError("\n\n".join(problems))
    try:
        cfg = HellbenderConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("\n\n".join(_format_validation_error(exc, raw))) from None
    conflicts = find_conflicts(cfg)
    if conflicts:
        raise ConfigError("\n\n".join(conflicts))
    prepared_path_is_default = cfg.dataset_prepared_path is None
    cfg = apply_derived_defaults(cfg)
    problems = find_path_problems(cfg, prepared_path_is_default)  # after the defaults, which place the cache
    if problems:
        raise ConfigError("\n\n".join(problems))
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> HellbenderConfig:
    raw = read_yaml(path)
    if not raw and not overrides:
        raise ConfigError(
            f"Config file `{path}` is empty: `base_model` is required, and `datasets:` to train on (see "
            "`hellbender examples` for complete configs)."
        )
    return validate_config(apply_overrides(raw, overrides or []))


def dump_config(cfg: HellbenderConfig) -> str:
    """The resolved config as YAML, every key included, in schema order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
