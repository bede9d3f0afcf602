"""pydantic's validation errors, translated into one paragraph per wrong key in the words of YAML."""

from __future__ import annotations

import difflib
import re
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from hellbender.config.keys import ENTRY_MODELS
from hellbender.config.schema import HellbenderConfig

_MISSING = object()
_SPECIFIC_ERRORS = (
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "finite_number",
    "value_error",
)
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


def user_path(loc: tuple[Any, ...], raw: Any) -> tuple[Any, ...]:
    """The key path of a pydantic error location as the user wrote it (without union members)."""
    return _split_loc(tuple(loc), raw)[0]


def _value_at(raw: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        raw = raw[part]
    return raw


def _top_level_parts(text: str) -> list[str]:
    """`a, f(b, c), d[e, g]` -> [`a`, `f(b, c)`, `d[e, g]`]: split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def _plain_tag(tag: str) -> str:
    """A union member's tag without the validators pydantic names in it: `function-before[check(), int]` and
    `constrained-int` are `int`, `tuple[function-before[check(), int], ...]` is `tuple[int, ...]`."""
    if tag.startswith("constrained-"):
        return _plain_tag(tag.removeprefix("constrained-"))
    head, bracket, inner = tag.partition("[")
    if not bracket or not inner.endswith("]"):
        return tag
    if head.startswith("function-"):
        return _plain_tag(_top_level_parts(inner[:-1])[-1])
    if head in ("list", "tuple", "dict"):
        return f"{head}[{', '.join(_plain_tag(part) for part in _top_level_parts(inner[:-1]))}]"
    return tag


def _describe_member(tag: str) -> str:
    """What a union member accepts, in YAML words: `bool` is true or false, `literal['a','b']` is 'a' or 'b'."""
    tag = _plain_tag(tag)
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
    return err["msg"].removeprefix("Value error, ").rstrip(".")


def _paragraph(loc: str, msg: str, value: Any) -> str:
    colon = "" if msg.startswith(("must ", "is ", "holds ")) else ":"
    return f"`{loc}`{colon} {msg} (got {_shown(value)})."


def _close_choice(err: dict[str, Any]) -> str:
    """` Did you mean `x`?` for a word close to one of the words a key takes (`cosin` for `cosine`)."""
    if err["type"] != "literal_error" or not isinstance(err.get("input"), str):
        return ""
    choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
    close = difflib.get_close_matches(err["input"], choices, n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""


def _model_inside(annotation: Any) -> type[BaseModel] | None:
    """The settings block a key's type holds (`QatSettings` for `QatSettings | None`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in get_args(annotation) if (found := _model_inside(arg)) is not None), None)


def _close_key(err: dict[str, Any], path: tuple[Any, ...]) -> str:
    """` Did you mean `qat.weight_dtype`?` for an unknown key inside a settings block, close to one it takes."""
    if err["type"] != "extra_forbidden" or len(path) < 2:
        return ""
    model: type[BaseModel] | None = HellbenderConfig
    for part in path[:-1]:
        if model is not None and not isinstance(part, int):  # list positions keep the items' block
            field = model.model_fields.get(str(part))
            model = _model_inside(field.annotation) if field is not None else None
    if model is None:
        return ""
    names = [field.alias or name for name, field in model.model_fields.items()]
    close = difflib.get_close_matches(str(path[-1]), names, n=1, cutoff=0.6)
    return f" Did you mean `{'.'.join(str(p) for p in (*path[:-1], close[0]))}`?" if close else ""


def describe_validation_error(exc: ValidationError, raw: dict[str, Any]) -> list[str]:
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
            # A value of a member's type that the member refuses (`-1` for a count that may also be `auto`, an
            # empty name where a list of names would do too) is told why, not what else the key takes.
            specific = [err for _, err in errs if err["type"] in _SPECIFIC_ERRORS]
            if specific:
                problems.append(_paragraph(loc, _plain_message(specific[0], path), value))
                continue
            accepted = ", or ".join(_describe_member(m) for m in members)
            problems.append(f"`{loc}` must be {accepted} (got {_shown(value)}).")
        else:
            for _, err in errs:
                problems.append(
                    _paragraph(loc, _plain_message(err, path), err.get("input"))
                    + _close_choice(err)
                    + _close_key(err, path)
                )
    return problems
