"""Batches of packed vision-language rows: several image+text documents per row, none attending to another.

Every document of the batch goes through the processor as a row of its own (`MultimodalCollator`, which also checks
that its expanded tokens still equal the prepared ones), so its images are processed exactly as they would be
unpacked. The documents are then joined back into their packed rows: per-token outputs (`input_ids`,
`mm_token_type_ids`, ...) are cut to each document's length and concatenated, and per-image outputs (pixel values,
`image_grid_thw`, `image_position_ids`, ...) stay as the processor returns them, in document order, which is the
order of the image tokens in the packed batch. Like packed text (`data/collator.py`), the batch has position ids
that restart at every document and no attention mask; the families whose rotary positions are not 1-D add theirs
from these in the trainer (`models/packed_vision.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hellbender.data.collator import REAL_TOKENS_KEY
from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.multimodal_collator import MultimodalCollator
from hellbender.data.streaming import STREAM_ROW_KEY
from hellbender.errors import DataError

# Processor outputs with one value per token. Every other output is per image and passes through as it is.
PER_TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "labels"})
# Per-image outputs of the families whose packing is tested (Qwen2.5-VL, Gemma 4, LLaVA, Idefics3; Idefics3's pixel
# values and pixel masks are per document, its images' tiles padded with blank ones). Anything else is refused rather
# than guessed at: joining an unknown output wrongly would misplace images silently.
PER_IMAGE_KEYS = frozenset(
    {"pixel_values", "pixel_attention_mask", "image_grid_thw", "image_position_ids", "num_soft_tokens_per_image"}
)


@dataclass
class PackedMultimodalCollator:
    documents: MultimodalCollator
    pad_token_id: int
    # Every document of the batch in one row, without padding (as `collator.one_packed_row` for text): for attention
    # that reads the documents from the position ids (flash attention) only in a batch of one row.
    one_row_per_batch: bool = False

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "seq_lens" not in rows[0]:  # unpacked rows (evaluation with `eval_sample_packing: false`)
            return self.documents(rows)
        docs = [doc for row in rows for doc in _documents(row)]
        if self.one_row_per_batch:  # every document starts unpredicted already, so the rows join as they are
            rows = [{"seq_lens": [n for row in rows for n in row["seq_lens"]]}]
        batch = self.documents(docs)
        lengths = batch.pop(REAL_TOKENS_KEY).tolist()
        stream_rows = batch.pop(STREAM_ROW_KEY, None)  # streamed documents' row numbers, for resuming
        unknown = sorted(set(batch) - PER_TOKEN_KEYS - PER_IMAGE_KEYS)
        if unknown:
            raise DataError(
                f"The processor returns {', '.join(unknown)}, which packed vision-language rows cannot be built "
                "with yet. Set `sample_packing: false`."
            )
        row_lengths = [sum(row["seq_lens"]) for row in rows]
        longest = max(row_lengths)
        out: dict[str, torch.Tensor] = {k: v for k, v in batch.items() if k in PER_IMAGE_KEYS}
        per_token = [k for k in batch if k in PER_TOKEN_KEYS and k != "attention_mask"]
        fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}
        for key in per_token:
            out[key] = torch.full((len(rows), longest), fill.get(key, 0), dtype=batch[key].dtype)
        position_ids = torch.zeros((len(rows), longest), dtype=torch.long)
        doc = 0
        for i, row in enumerate(rows):
            start = 0
            for n in row["seq_lens"]:
                if lengths[doc] != n:  # MultimodalCollator checked the ids; this guards the join itself
                    raise DataError(f"A packed document has {lengths[doc]} tokens, not the prepared {n}.")
                for key in per_token:
                    out[key][i, start : start + n] = batch[key][doc, :n]
                if "labels" in out:  # never predicted from the previous document's last token
                    out["labels"][i, start] = IGNORE_INDEX
                position_ids[i, start : start + n] = torch.arange(n)
                start += n
                doc += 1
            # Padding after the last document is a block of its own, as in packed text rows.
            position_ids[i, start:] = torch.arange(longest - start)
        out["position_ids"] = position_ids
        out[REAL_TOKENS_KEY] = torch.tensor(row_lengths)
        if stream_rows is not None:
            out[STREAM_ROW_KEY] = stream_rows
        return out


def _documents(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The prepared rows a packed row was made of: their tokens and labels cut from the packed ones, their texts and
    images as prepared. Bins of pre-tokenized rows (`data/pretokenized_packing.py`) and of streamed documents
    (`streaming.StreamingPackedMultimodalDataset`) hold their documents whole."""
    if "input_ids" not in row:
        return list(row["documents"])
    docs, start = [], 0
    for n, doc in zip(row["seq_lens"], row["documents"], strict=True):
        docs.append(
            {**doc, "input_ids": row["input_ids"][start : start + n], "labels": row["labels"][start : start + n]}
        )
        start += n
    return docs
