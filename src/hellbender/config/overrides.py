"""`--set KEY=VALUE` overrides applied to the raw config before it is validated."""

from __future__ import annotations

from typing import Any

from hellbender.config.yaml_file import yaml_value
from hellbender.errors import ConfigError


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set key=value` overrides. Values are parsed as YAML; dotted keys reach into lists and mappings
    (`datasets.0.path=data.jsonl`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"Override `{item}` is not of the form KEY=VALUE (e.g. `--set learning_rate=1e-4`).")
        shown = item if len(item) <= 80 else item[:77] + "..."
        value = yaml_value(text, f"Override `{shown}`") if text else None
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
