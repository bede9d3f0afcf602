"""Older Axolotl spellings of keys hellbender knows by today's name: each is read as today's key, with one notice
line naming the modern spelling, so configs written for earlier Axolotl releases run unchanged."""

from __future__ import annotations

from typing import Any

# older top-level key -> today's key
TOP_LEVEL: dict[str, str] = {
    "dataset_processes": "dataset_num_proc",
}
# older dataset-entry key -> the key of `message_property_mappings` it sets
ENTRY_MESSAGE_FIELDS: dict[str, str] = {
    "message_field_role": "role",
    "message_field_content": "content",
}
ENTRY_LISTS = ("datasets", "test_datasets")


def read_older_spellings(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rewrite older spellings in `raw` to today's keys. Returns (problems, notices): a key given in both spellings
    with different values is a problem; each rewrite is a notice."""
    problems: list[str] = []
    notices: list[str] = []
    for old, new in TOP_LEVEL.items():
        if old in raw:
            _move(raw, old, new, "", problems, notices)
    _activation_offloading(raw, problems, notices)
    for list_key in ENTRY_LISTS:
        entries = raw.get(list_key)
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, dict):
                continue
            where = f"In `{list_key}[{i}]`: "
            for old, part in ENTRY_MESSAGE_FIELDS.items():
                if old not in entry:
                    continue
                value = entry.pop(old)
                mappings = entry.setdefault("message_property_mappings", {})
                if not isinstance(mappings, dict):
                    continue  # the mapping's own type error is reported by validation
                if part in mappings and mappings[part] != value:
                    problems.append(
                        f"{where}`{old}: {value}` and `message_property_mappings.{part}: {mappings[part]}` say "
                        f"different things; keep `message_property_mappings` (today's spelling)."
                    )
                    continue
                mappings[part] = value
                notices.append(
                    f"{where}`{old}` is an older spelling; read as `message_property_mappings.{part}: {value}`."
                )
    return problems, notices


def _activation_offloading(raw: dict[str, Any], problems: list[str], notices: list[str]) -> None:
    """Axolotl's `activation_offloading: true` is hellbender's `gradient_checkpointing: offload`."""
    value = raw.get("activation_offloading")
    if value is None or value is False:
        raw.pop("activation_offloading", None)
        return
    if value is not True:
        problems.append(
            f"`activation_offloading: {value}` is not offered: hellbender offloads checkpointed activations to host "
            "memory only (`activation_offloading: true`, or `gradient_checkpointing: offload`)."
        )
        raw.pop("activation_offloading")
        return
    if raw.get("gradient_checkpointing") not in (None, True, "offload"):
        problems.append(
            "`activation_offloading: true` offloads the activations of checkpointed layers, and "
            f"`gradient_checkpointing` is {raw['gradient_checkpointing']!r}: set it to true (or remove one of them)."
        )
        raw.pop("activation_offloading")
        return
    raw.pop("activation_offloading")
    raw["gradient_checkpointing"] = "offload"
    notices.append("`activation_offloading: true` is read as `gradient_checkpointing: offload`.")


def _move(raw: dict[str, Any], old: str, new: str, where: str, problems: list[str], notices: list[str]) -> None:
    value = raw.pop(old)
    if new in raw and raw[new] != value:
        problems.append(
            f"{where}`{old}: {value}` and `{new}: {raw[new]}` are the same key in two spellings with "
            f"different values; keep `{new}` (today's spelling)."
        )
        return
    raw[new] = value
    notices.append(f"{where}`{old}` is an older spelling of `{new}`; read as `{new}: {value}`.")
