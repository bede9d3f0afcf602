"""Value types shared by the config keys, so that every key of a kind refuses the same bad values at validation
(instead of crashing or misbehaving once training has started):

- `Int`: a whole number, never a boolean (pydantic's lax mode reads `true` as 1), within a 64-bit integer (torch,
  numpy and the tokenizers library cannot hold a larger one);
- `Float`: a finite number (no `.inf` / `.nan`), never a boolean; integers and numeric text (`2e-5`, which YAML 1.1
  reads as text) are accepted;
- `Name`: text that names something (a split, a column, a token, a class): not empty, no NUL byte;
- `PathText`: a file, directory, hub id or URL: not empty, no NUL byte (the operating system refuses one).

Lone surrogates (a `\\uD800` escape in YAML) are refused in every key and text value before the schema runs
(`lone_surrogate_problems`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

INT64_MAX = 2**63 - 1
# transformers' `set_seed` also seeds numpy, which takes seeds from 0 to 2**32 - 1 (torch would take up to 2**64 - 1).
SEED_MAX = 2**32 - 1


def _not_a_boolean(kind: str):
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(
                f"must be {kind}, not {str(value).lower()} (YAML reads true/false, yes/no and on/off as booleans)"
            )
        return value

    return check


def _a_finite_number(value: Any) -> Any:
    """Said before any range check, which NaN fails too (it compares false to everything)."""
    value = _not_a_boolean("a number")(value)
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return value  # pydantic says what it should be
    if not math.isfinite(number):
        raise ValueError("must be a finite number (YAML's `.inf` and `.nan` are not)")
    return value


def lone_surrogate_problems(raw: Any, where: str = "") -> list[str]:
    """One paragraph for each key or text value of the raw config holding a lone surrogate (a `\\uD800` escape in
    YAML: half of a UTF-16 pair, which no path, tokenizer or UTF-8 text can hold). Checked before the schema, because
    any message that echoes such a value cannot be printed, and pydantic itself fails on one."""
    problems = []
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        name = f"{where}.{key}" if where else str(key)
        if isinstance(key, str) and (bad := _lone_surrogate(key)):
            problems.append(
                f"The key {ascii(key)}{f' under `{where}`' if where else ''} holds a lone surrogate (`{bad}`){_SURROGATE_FIX}"
            )
        elif isinstance(value, str) and (bad := _lone_surrogate(value)):
            problems.append(f"`{name}` holds a lone surrogate (`{bad}`){_SURROGATE_FIX}")
        else:
            problems += lone_surrogate_problems(value, name)
    return problems


_SURROGATE_FIX = (
    ", half of a UTF-16 pair: not a character, and it cannot be written as UTF-8. Remove the escape or write the "
    "character it was meant to be."
)


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate of `text` as a `\\uXXXX` escape, or None."""
    bad = next((c for c in text if "\ud800" <= c <= "\udfff"), None)
    return None if bad is None else f"\\u{ord(bad):04X}"


def _a_name(value: str) -> str:
    if not value.strip():
        raise ValueError("is empty: write the name it stands for, or leave the key out where it has a default")
    if "\0" in value:
        raise ValueError("holds a NUL byte (`\\0`), which no name or path may contain")
    return value


def _a_path(value: str) -> str:
    if not value.strip():
        raise ValueError(
            "is an empty path: write the file, directory, hub id or URL it names (`.` is the current directory)"
        )
    if "\0" in value:
        raise ValueError("holds a NUL byte (`\\0`), which the operating system refuses in a path")
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean("an integer")), Field(le=INT64_MAX)]
Float = Annotated[float, BeforeValidator(_a_finite_number), Field(allow_inf_nan=False)]
Name = Annotated[str, AfterValidator(_a_name)]
PathText = Annotated[str, AfterValidator(_a_path)]


def did_you_mean(value: str, names: Iterable[str]) -> str:
    """` (did you mean `x`?)` when one of `names` is close to `value`, else ``."""
    close = difflib.get_close_matches(value, list(names), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""
