"""Prepared pairs for TRL's legacy pair trainers (ORPO, and CPO for SimPO), which tokenize in their own
`tokenize_row`: here that becomes a column conversion that adds, drops and truncates no token."""

from __future__ import annotations

from typing import Any

import torch

from hellbender.data.formats.base import IGNORE_INDEX


def legacy_pair_columns(row: dict[str, Any]) -> dict[str, list[int]]:
    """The columns the legacy trainers read after `tokenize_row`, from one prepared pair: each answer's sequence is
    the prompt followed by the answer, and its labels hide the prompt (-100), so only answer tokens are scored."""
    prompt = list(row["prompt_ids"])
    columns = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side in ("chosen", "rejected"):
        answer = list(row[f"{side}_ids"])
        columns[f"{side}_input_ids"] = prompt + answer
        columns[f"{side}_attention_mask"] = [1] * (len(prompt) + len(answer))
        columns[f"{side}_labels"] = [IGNORE_INDEX] * len(prompt) + answer
    return columns


class PreTokenizedPairs:
    """Mixed in before a legacy pair trainer. Its initialisation maps `tokenize_row` over the datasets; the
    prompt-extraction and chat-template passes before it leave rows without text columns unchanged."""

    def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, list[int]]:
        return legacy_pair_columns(feature)

    def batch_tokens(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input tokens, trained tokens): both answers' sequences, and their answer tokens."""
        sides = ("chosen", "rejected")
        real = sum(inputs[f"{side}_attention_mask"].sum() for side in sides)
        trained = sum((inputs[f"{side}_labels"] != IGNORE_INDEX).sum() for side in sides)
        return real, trained
