"""Batches of preference pairs whose prompts hold images, for TRL's DPOTrainer.

The token side is laid out as TRL's `DataCollatorForPreference` lays out prepared pairs: `input_ids` holds every row's
prompt + chosen answer, then every row's prompt + rejected answer, right-padded, with `attention_mask` and
`completion_mask` (the answer tokens, the only ones scored). The processor turns each row's rendered prompt and its
images into the model's vision inputs, once per batch; its prompt tokens must equal the prepared ones (a changed image
or processor is refused, as for multimodal SFT). The vision inputs are then repeated for the rejected half, in row
order, and per-token inputs such as `mm_token_type_ids` continue over the answers as text (0). TRL passes every key
but `completion_mask` and the reference log-probs to the model, in the policy's and the reference's forward alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hellbender.data.images import ImagePolicy
from hellbender.data.multimodal_collator import prepared_images
from hellbender.data.preference_images import BASE_DIR, PIXELS, PROMPT_IMAGES, PROMPT_TEXT
from hellbender.errors import DataError

# Processor outputs with one value per token: laid out over prompt + answer like `input_ids`. Every other tensor holds
# one entry per row or per image (pixel values, image grids, positions), in row order, and is repeated.
TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")


@dataclass
class VisionPreferenceCollator:
    processor: Any
    policy: ImagePolicy
    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        images = [
            prepared_images({"images": row[PROMPT_IMAGES], "pixels": row.get(PIXELS), BASE_DIR: row[BASE_DIR]},
                            self.policy)
            for row in rows
        ]  # fmt: skip
        processed = self.processor(
            text=[row[PROMPT_TEXT] for row in rows],
            images=images if any(images) else None,
            padding=True,
            padding_side="right",
            add_special_tokens=False,
            return_tensors="pt",
        )
        prompt_lengths = processed["attention_mask"].sum(dim=1).tolist()
        for i, row in enumerate(rows):
            if processed["input_ids"][i, : prompt_lengths[i]].tolist() != list(row["prompt_ids"]):
                raise DataError(
                    f"The processor now expands the images of a prepared pair differently "
                    f"({', '.join(row[PROMPT_IMAGES]) or 'no images'}). The images or the processor changed since "
                    "the data was prepared; delete the prepared data (`dataset_prepared_path`) and run again."
                )
        sequences = [(row["prompt_ids"], row[f"{name}_ids"]) for name in ("chosen", "rejected") for row in rows]
        width = max(len(prompt) + len(answer) for prompt, answer in sequences)
        out = {
            "input_ids": torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(sequences), width), dtype=torch.long),
            "completion_mask": torch.zeros((len(sequences), width), dtype=torch.long),
        }
        token_keys = [key for key in TOKEN_KEYS if key in processed]
        for key in token_keys:
            out[key] = torch.zeros((len(sequences), width), dtype=processed[key].dtype)
        for i, (prompt, answer) in enumerate(sequences):
            n, total = len(prompt), len(prompt) + len(answer)
            out["input_ids"][i, :total] = torch.tensor([*prompt, *answer])
            out["attention_mask"][i, :total] = 1
            out["completion_mask"][i, n:total] = 1
            for key in token_keys:  # the prompt's values; the answers are text (0)
                out[key][i, :n] = processed[key][i % len(rows), :n]
        for key, value in processed.items():
            if key in ("input_ids", "attention_mask", *TOKEN_KEYS):
                continue
            if not isinstance(value, torch.Tensor):
                raise DataError(
                    f"The processor gives `{key}` as {type(value).__name__}, which the preference collator cannot "
                    "repeat for the rejected answers; this vision-language family is not supported for preference "
                    "tuning yet."
                )
            out[key] = torch.cat([value, value])  # the chosen rows' images, then the same for the rejected rows
        return out


def preference_collator(cfg: Any, tokenizer: Any, processor: Any | None) -> VisionPreferenceCollator | None:
    """The collator of the config's preference pairs: None for text pairs (TRL's `DataCollatorForPreference` batches
    their prepared ids), the vision collator when a processor is configured."""
    if processor is None:
        return None
    from hellbender.data.contexts import image_policy

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return VisionPreferenceCollator(processor, image_policy(cfg), pad)
