"""Axolotl's `skip_prepare_dataset: true` on conversations: its collator then tokenizes each batch as it is drawn.
hellbender prepares conversations once before training (the same tokens and labels, cached for the next run), so
for them the key changes nothing; it keeps its own meaning for already-tokenized `multimodal_pretrain` rows."""

from __future__ import annotations

from typing import Any


def read_skip_prepare_dataset(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Drop `skip_prepare_dataset: true` from `raw` when every dataset entry is a conversation. Returns (problems,
    notices)."""
    if raw.get("skip_prepare_dataset") is not True:
        return [], []
    entries = [e for e in raw.get("datasets") or [] if isinstance(e, dict)]
    if not entries or any(e.get("type") != "chat_template" for e in entries):
        return [], []
    del raw["skip_prepare_dataset"]
    return [], [
        "`skip_prepare_dataset: true` asks Axolotl to tokenize conversations batch by batch; hellbender prepares "
        "them once before training (the same tokens and labels, cached for the next run), so it changes nothing here."
    ]
