"""`skip_prepare_dataset: true` with already-tokenized `multimodal_pretrain` rows.

Rows hold `_mm_text` (the text with one image token per image), `images`, `input_ids`, optionally
`attention_mask` and `labels`. They are used as they are — nothing is tokenized or cached — except that image
paths are resolved inside `image_base_dir` when a row is read. At batch time the processor re-processes
`_mm_text` with the images so image tokens expand correctly, and the row's labels are aligned to the
expanded tokens (see `MultimodalCollator`).
"""

from __future__ import annotations

from typing import Any

import torch

from hellbender.config import HellbenderConfig
from hellbender.data.contexts import image_base_dir, image_policy
from hellbender.data.formats.base import IGNORE_INDEX, UNEXPANDED_KEY
from hellbender.data.images import ImagePolicy, ImageProblem, image_reference, resolve_image
from hellbender.data.sources import load_rows
from hellbender.errors import DataError

TEXT_KEY = "_mm_text"
REQUIRED_COLUMNS = (TEXT_KEY, "input_ids")


class PretokenizedMultimodalRows(torch.utils.data.Dataset):
    def __init__(self, rows: Any, policy: ImagePolicy, where: str, image_column: str) -> None:
        missing = [c for c in REQUIRED_COLUMNS if c not in rows.column_names]
        if missing:
            raise DataError(
                f"{where}: `skip_prepare_dataset` rows need the columns {', '.join(REQUIRED_COLUMNS)} (and `images`, "
                f"`attention_mask`, `labels`); missing: {', '.join(missing)}."
            )
        self.rows, self.policy, self.where, self.image_column = rows, policy, where, image_column

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        ids = list(row["input_ids"])
        labels = list(row["labels"]) if row.get("labels") is not None else list(ids)
        mask = row.get("attention_mask") or [1] * len(ids)
        if not (len(ids) == len(labels) == len(mask)):
            raise DataError(f"{self.where}, row {index}: `input_ids`, `labels` and `attention_mask` differ in length.")
        keep = [i for i, m in enumerate(mask) if m]  # padding in the row is dropped; batches are padded anew
        try:
            paths = [resolve_image(image_reference(ref), self.policy) for ref in row.get(self.image_column) or []]
        except ImageProblem as exc:
            raise DataError(f"{self.where}, row {index}: {exc}.") from None
        return {
            "text": row[TEXT_KEY],
            "images": [str(p) for p in paths],
            "image_base_dir": str(self.policy.base_dir.resolve()),
            "input_ids": [ids[i] for i in keep],
            "labels": [labels[i] if labels[i] >= 0 else IGNORE_INDEX for i in keep],
            UNEXPANDED_KEY: True,
        }


def pretokenized_multimodal_rows(cfg: HellbenderConfig) -> torch.utils.data.Dataset:
    parts = []
    for i, entry in enumerate(cfg.datasets):
        where = f"Dataset datasets[{i}] `{entry.path}`"
        policy = image_policy(cfg, base_dir=image_base_dir(entry, where), allow_remote=entry.allow_remote_images)
        parts.append(
            PretokenizedMultimodalRows(
                load_rows(entry, where=where),
                policy,
                f"datasets[{i}] `{entry.path}`",
                entry.image_column,
            )
        )
    return parts[0] if len(parts) == 1 else torch.utils.data.ConcatDataset(parts)
