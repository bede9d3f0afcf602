"""`train(CONFIG)` with each GRPO completion sampled from a random state of its own, so that the completions do not
depend on how the batch is split between processes. Run in one process by tests/test_grpo_e2e.py and in two by
torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/grpo_seeded_run.py CONFIG

Sampling draws from one random stream per process: a batch of 8 completions in one process and two batches of 4 in
two processes draw different numbers, whatever the seed. Seeding each completion by (step, its prompt's tokens, its
copy number within the batch) makes the generated completions the same however the global batch is split; what the
runs then compare is everything after generation (rewards, advantages, loss, gradients, weights).
"""

from __future__ import annotations

import sys
import zlib
from collections import Counter
from typing import Any

import torch
from transformers import TrainerCallback


class RowSeededSampling(TrainerCallback):
    """Wraps the trained model's `generate` (this instance only) to sample one prompt at a time, each from its own
    seed; the result is laid out as a batched `generate` lays it out (prompts as given, then the new tokens, padded)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        original = model.generate

        def generate(input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any, **rest: Any):
            copies: Counter = Counter()
            new_tokens = []
            for ids, mask in zip(input_ids, attention_mask, strict=True):
                prompt = ids[mask.bool()]
                key = tuple(prompt.tolist())
                seed = zlib.crc32(repr((state.global_step, key, copies[key])).encode())
                copies[key] += 1
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    out = original(
                        input_ids=prompt[None],
                        attention_mask=torch.ones_like(prompt)[None],
                        generation_config=generation_config,
                        **rest,
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
    from hellbender.train.run import train

    train(load_config(config), callbacks=[RowSeededSampling()])


if __name__ == "__main__":
    main(sys.argv[1])
