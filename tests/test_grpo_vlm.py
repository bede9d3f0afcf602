"""GRPO and RLOO on prompts with images, for the tiny Qwen2.5-VL and Gemma 4: the images are found and checked through
hellbender's image sandbox before training (paths relative to `image_base_dir`, which none may leave), opened per
batch as TRL's `images`, expanded into the prompt's image tokens and given to the model's forward as pixels; the
reward functions receive the completions and, for each, its prompt's image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hellbender.config.loading import validate_config
from hellbender.errors import ConfigError, DataError
from tests.conftest import EXAMPLES, write_jsonl
from tests.helpers import vlm_config
from tests.tiny_vlms import GEMMA4, QWEN, TINY_VLMS

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

IMAGES = EXAMPLES / "data"  # the bundled coloured squares: shapes/000.png ...
SPECS = {GEMMA4: TINY_VLMS["gemma4"], QWEN: TINY_VLMS["qwen2.5-vl"]}
# Writes what each call receives (one JSON line per call): the completions, and the colour of each completion's image
# beside the row's `colour` column, so the test sees that each prompt got its own image. Rewards the word count.
REWARDS = """
import json
import os

CHANNELS = ("red", "green", "blue")


def seen(prompts, completions, images, colour, **kwargs):
    def colour_of(image):
        pixel = image.getpixel((image.width // 2, image.height // 2))
        return CHANNELS[max(range(3), key=lambda c: pixel[c])]

    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        record = {
            "texts": [c[0]["content"] for c in completions],
            "image_colours": [[colour_of(image) for image in row] for row in images],
            "colours": list(colour),
        }
        f.write(json.dumps(record) + "\\n")
    return [float(len(c[0]["content"].split())) for c in completions]
"""


def square_colour(index: int) -> str:
    from PIL import Image

    with Image.open(IMAGES / "shapes" / f"{index:03d}.png") as image:
        pixel = image.convert("RGB").getpixel((image.width // 2, image.height // 2))
    return ("red", "green", "blue")[max(range(3), key=lambda c: pixel[c])]


def image_prompt(index: int, column: bool = False, path: str | None = None) -> dict:
    question = "What colour is the square?"
    image = path or f"shapes/{index:03d}.png"
    content = question if column else [{"type": "image", "path": image}, {"type": "text", "text": question}]
    row = {"prompt": [{"role": "user", "content": content}], "colour": square_colour(index)}
    if column:
        row["images"] = [image]
    return row


def grpo_vlm_config(tmp_path: Path, model: str, rows: list[dict] | None = None, trl: dict | None = None, **overrides):
    data = write_jsonl(tmp_path / "prompts.jsonl", rows if rows is not None else [image_prompt(i) for i in range(8)])
    (tmp_path / "rewards.py").write_text(REWARDS)
    block = {"reward_funcs": ["rewards.seen"], "num_generations": 2, "max_completion_length": 3}
    settings = dict(
        rl="grpo",
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        micro_batch_size=4,
        max_steps=2,
        datasets=[{"path": str(data), "image_base_dir": str(IMAGES)}],
        trl={**block, **(trl or {}), "reward_funcs_dir": str(tmp_path)},
    )
    return validate_config(vlm_config(tmp_path, model, **{**settings, **overrides}))


def per_image(pixels: torch.Tensor, images: int = 4) -> torch.Tensor:
    """Each image's pixel values as one row, the rows in a fixed order (TRL shuffles a batch's prompts)."""
    rows = pixels.reshape(images, -1)
    return rows[rows.sum(dim=1).argsort()]


def reward_calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", [QWEN, GEMMA4])
def test_grpo_gives_each_prompts_image_to_the_model_and_the_reward_functions(tmp_path, model):
    """Steps of 2 prompts x 2 completions: every generated batch's prompt ids hold one image's tokens per prompt,
    the pixels of each prompt's image reach the model's forward in training, and the reward function receives four
    completions per call, each with the image of its own prompt (its colour is the row's `colour` column)."""
    from tests.test_grpo import recording_trainer

    steps = 2 if model == QWEN else 1  # Gemma 4's tiny model is the slower one
    # A red and a green square: each step draws both prompts (one epoch), so a mix-up of images would show.
    cfg = grpo_vlm_config(tmp_path, model, rows=[image_prompt(0), image_prompt(1)], max_steps=steps)
    trainer, batches = recording_trainer(cfg)
    pixels: list[torch.Tensor | None] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: pixels.append(kwargs.get("pixel_values")), with_kwargs=True
    )
    trainer.train()
    image_token = trainer.model.config.image_token_id
    assert len(batches) == steps
    for batch in batches:
        per_prompt = (batch["prompt_ids"] == image_token).sum(dim=1)
        assert per_prompt.tolist() == [SPECS[model].tokens_per_image] * 4
        assert batch["num_images"] == [1, 1, 1, 1]
    assert len(pixels) >= steps and all(p is not None for p in pixels)
    for seen, batch in zip(pixels, batches, strict=False):  # each step's training forward gets its batch's pixels
        torch.testing.assert_close(per_image(seen), per_image(batch["pixel_values"].to(seen.dtype)))
    calls = reward_calls(tmp_path)
    assert len(calls) == steps
    for call in calls:
        assert len(call["texts"]) == 4 and all(isinstance(t, str) for t in call["texts"])
        assert [colours[0] for colours in call["image_colours"]] == call["colours"]
    assert all(sorted(set(call["colours"])) == ["green", "red"] for call in calls)


def test_rloo_trains_on_images_from_an_image_column_through_hellbender_train(tmp_path):
    """`rl: rloo` through `hellbender train`'s own path, with each row's image in the `images` column (placed before
    the question, as for multimodal SFT): the rewards see the right images and the run saves its adapter."""
    from hellbender.train.run import train

    cfg = grpo_vlm_config(tmp_path, QWEN, rows=[image_prompt(i, column=True) for i in range(8)], rl="rloo")
    train(cfg)
    calls = reward_calls(tmp_path)
    assert len(calls) == 2 and all(len(call["texts"]) == 4 for call in calls)
    for call in calls:
        assert [colours[0] for colours in call["image_colours"]] == call["colours"]
    assert (Path(cfg.output_dir) / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        (image_prompt(1, path="../../secret.png"), ["row 1", "outside `image_base_dir`"]),
        (image_prompt(1, path="shapes/missing.png"), ["row 1", "does not exist"]),
        ({"prompt": "What colour?", "images": ["shapes/001.png"], "colour": "red"}, ["row 1", "list of chat messages"]),
        (
            {**image_prompt(1), "images": ["shapes/001.png"]},
            ["row 1", "both image parts in its messages and an image column"],
        ),
    ],
)
def test_a_bad_image_row_stops_before_training_with_its_number(tmp_path, row, needles):
    from hellbender.data.grpo_rows import grpo_rows

    rows = [image_prompt(0, column="images" in row), row]
    cfg = grpo_vlm_config(tmp_path, QWEN, rows=rows)
    with pytest.raises(DataError) as error:
        grpo_rows(cfg)
    for needle in needles:
        assert needle in str(error.value), str(error.value)
    assert "\n\n" not in str(error.value)


def test_image_columns_of_a_text_run_and_keys_the_rows_do_not_read_are_refused(tmp_path):
    from hellbender.data.grpo_rows import grpo_rows
    from tests.test_grpo import grpo_config

    text = grpo_config(tmp_path)
    write_jsonl(Path(text.datasets[0].path), [{"prompt": "a square", "image": "shapes/000.png"}])
    with pytest.raises(DataError, match=r"column `image`, which TRL reads as the prompt's images.*`processor_type`"):
        grpo_rows(text)
    with pytest.raises(ConfigError, match=r"`cache_images` cannot be used with `rl: grpo`"):
        grpo_vlm_config(tmp_path, QWEN, cache_images=True)
