"""`train(CONFIG)` with each GRPO completion sampled from a random state of its own, so that the completions do not
depend on how the batch is split between processes. Run in one process by tests/test_grpo_e2e.py and
tests/test_grpo_vlm.py, and in two by torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/grpo_seeded_run.py CONFIG

Sampling draws from one random stream per process: a batch of 8 completions in one process and two batches of 4 in
two processes draw different numbers, whatever the seed. Seeding each completion by (step, its prompt's tokens and
images, its copy number within the batch) makes the generated completions the same however the global batch is split;
what the runs then compare is everything after generation (rewards, advantages, loss, gradients, weights).
"""

from __future__ import annotations

import sys
import zlib
from collections import Counter
from typing import Any

import torch
from transformers import TrainerCallback

# Vision inputs laid out like input_ids ([batch, prompt length], left-padded): a row's are its unpadded positions.
PER_TOKEN = frozenset({"token_type_ids", "mm_token_type_ids"})
# Qwen2-VL's layout (Qwen2.5-VL, Qwen3-VL): `pixel_values` holds the patches of all the batch's images, concatenated
# in row order, and `image_grid_thw` each image's (t, h, w); one image is t*h*w patches and t*h*w / merge^2 image
# tokens in its prompt.
GRID = frozenset({"pixel_values", "image_grid_thw"})


def rows_vision_inputs(
    config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: dict[str, Any]
) -> list[dict[str, torch.Tensor]]:
    """`vision` (what `generate` got besides the prompts) cut into each row's own inputs, as the processor gives them
    for that prompt alone; a row without images gets no pixels. Raises on an input it does not know how to cut, rather
    than give every row the whole batch's."""
    unknown = vision.keys() - PER_TOKEN - GRID
    if unknown or 0 < len(GRID & vision.keys()) < len(GRID):  # or pixels without their grid, or the reverse
        raise NotImplementedError(
            f"RowSeededSampling cannot cut generate's inputs {sorted(vision)} per row: it knows per-token inputs "
            f"{sorted(PER_TOKEN)} and Qwen-VL's pixel_values with image_grid_thw"
        )
    masks = attention_mask.bool()
    rows: list[dict[str, torch.Tensor]] = [
        {key: vision[key][i][masks[i]][None] for key in PER_TOKEN & vision.keys()} for i in range(len(input_ids))
    ]
    if "pixel_values" not in vision:
        return rows
    grid, pixels = vision["image_grid_thw"], vision["pixel_values"]
    patches = grid.prod(dim=-1).tolist()
    tokens = [n // config.vision_config.spatial_merge_size**2 for n in patches]
    image = patch = 0
    for i, row in enumerate(rows):
        first, wanted = image, int((input_ids[i][masks[i]] == config.image_token_id).sum())
        while wanted > 0 and image < len(tokens):
            wanted -= tokens[image]
            image += 1
        if wanted != 0:
            raise ValueError(f"row {i}'s image tokens do not add up to whole images of image_grid_thw {grid.tolist()}")
        if image > first:
            size = sum(patches[first:image])
            row["pixel_values"], row["image_grid_thw"] = pixels[patch : patch + size], grid[first:image]
            patch += size
    if image != len(patches) or patch != len(pixels):
        raise ValueError(f"{len(patches) - image} images and {len(pixels) - patch} patches belong to no row")
    return rows


def digest(row: dict[str, torch.Tensor]) -> int:
    """A checksum of a row's vision inputs, for its seed: prompts of the same text differ by their pixels."""
    return zlib.crc32(b"".join(row[key].cpu().flatten().view(torch.uint8).numpy().tobytes() for key in sorted(row)))


class RowSeededSampling(TrainerCallback):
    """Wraps the trained model's `generate` (this instance only) to sample one prompt at a time, each with its own
    vision inputs and from its own seed; the result is laid out as a batched `generate` lays it out (prompts as given,
    then the new tokens, padded)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        original = model.generate

        def generate(input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any, **vision: Any):
            copies: Counter = Counter()
            new_tokens = []
            rows = rows_vision_inputs(model.config, input_ids, attention_mask, vision)
            for ids, mask, row in zip(input_ids, attention_mask, rows, strict=True):
                prompt = ids[mask.bool()]
                key = (tuple(prompt.tolist()), digest(row)) if row else tuple(prompt.tolist())
                seed = zlib.crc32(repr((state.global_step, key, copies[key])).encode())
                copies[key] += 1
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    out = original(
                        input_ids=prompt[None],
                        attention_mask=torch.ones_like(prompt)[None],
                        generation_config=generation_config,
                        **row,
                    )
                new_tokens.append(out[0, len(prompt) :])
            width = max(len(t) for t in new_tokens)
            pad = generation_config.pad_token_id
            pad = pad if pad is not None else generation_config.eos_token_id
            pad = pad[0] if isinstance(pad, list) else pad
            padded = [torch.nn.functional.pad(t, (0, width - len(t)), value=pad) for t in new_tokens]
            return torch.cat([input_ids, torch.stack(padded)], dim=1)

        model.generate = generate


def main(config: str) -> None:
    from hellbender.config import load_config
    from hellbender.train.distributed import close_process_group
    from hellbender.train.run import train

    train(load_config(config), callbacks=[RowSeededSampling()])
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
