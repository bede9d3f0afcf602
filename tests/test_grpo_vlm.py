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
# `seen` writes what each call receives (one JSON line per call): the process's rank, the completions, and the colour
# of each completion's image beside the row's `colour` column, so the test sees that each prompt got its own image. It
# rewards the word count; `colour_index` rewards what the image shows (red 0, green 1, blue 2), `characters` the
# completion's length in characters (which differs more often between a prompt's completions than its word count).
REWARDS = """
import json
import os

CHANNELS = ("red", "green", "blue")


def colour_of(image):
    pixel = image.getpixel((image.width // 2, image.height // 2))
    return CHANNELS[max(range(3), key=lambda c: pixel[c])]


def seen(prompts, completions, images, colour, **kwargs):
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        record = {
            "rank": int(os.environ.get("RANK", "0")),
            "texts": [c[0]["content"] for c in completions],
            "image_colours": [[colour_of(image) for image in row] for row in images],
            "colours": list(colour),
        }
        f.write(json.dumps(record) + "\\n")
    return [float(len(c[0]["content"].split())) for c in completions]


def colour_index(completions, images, **kwargs):
    return [float(CHANNELS.index(colour_of(row[0]))) for row in images]


def characters(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]
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
    return validate_config(grpo_vlm_settings(tmp_path, model, rows, trl, **overrides))


def grpo_vlm_settings(
    tmp_path: Path, model: str, rows: list[dict] | None = None, trl: dict | None = None, **overrides
) -> dict:
    """A short LoRA GRPO run of `model` on `rows` (default: 8 image prompts), its prompts and `REWARDS` in tmp_path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
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
    return vlm_config(tmp_path, model, **{**settings, **overrides})


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


def test_two_processes_train_on_images_like_one_with_the_same_global_batch(tmp_path):
    """Qwen2.5-VL (LoRA) on four image prompts (a red, a green, a red and a blue square) x 2 completions: 8
    completions per step in one process, and 4 in each of two processes (torchrun, gloo). Every step logs the same
    rewards, reward spread, loss, gradient norm and completion length in both, the final adapters are equal, and each
    step's completions are the same texts for the same images: the two processes between them generate, score and
    train on what the one process does. Each process's reward calls get, for every completion, the image of its own
    prompt (its colour is the row's `colour` column); a process that dropped its images fails, and pixels given to the
    wrong row or process change the completions or the gradient norm (each process's batch has completions of unequal
    rewards, so its pixels reach the gradient). `beta: 0.1` makes the second step's loss depend on the model's
    log-probabilities too (the KL term), not only on the advantages. Completions are sampled from seeds of their own,
    as in tests/test_grpo_e2e.py, each with its own row's pixels (tests/grpo_seeded_run.py)."""
    import yaml

    from hellbender.train.run import train
    from tests.conftest import REPO
    from tests.grpo_seeded_run import RowSeededSampling
    from tests.helpers import final_weights
    from tests.test_distributed import run_torchrun
    from tests.test_grpo_e2e import per_step

    trl = {
        "reward_funcs": ["rewards.seen", "rewards.colour_index", "rewards.characters"],
        "num_generations": 2,
        "max_completion_length": 3,
        "scale_rewards": "batch",
        "beta": 0.1,
    }
    common = dict(rows=[image_prompt(i) for i in range(4)], trl=trl, max_steps=2, learning_rate=2e-2)
    single = tmp_path / "single"
    train(grpo_vlm_config(single, QWEN, micro_batch_size=8, **common), callbacks=[RowSeededSampling()])
    ddp = tmp_path / "ddp"
    config = ddp / "config.yml"
    config.write_text(yaml.safe_dump(grpo_vlm_settings(ddp, QWEN, micro_batch_size=4, **common)))
    run_torchrun(REPO / "tests" / "grpo_seeded_run.py", str(config), OMP_NUM_THREADS="1")

    expected, got = per_step(single / "out"), per_step(ddp / "out")
    assert sorted(expected) == sorted(got) == [1, 2]
    assert all(v[1] > 0 for v in expected.values())  # each step trained: its completions' rewards differ
    for step, values in expected.items():
        assert got[step] == pytest.approx(values, abs=1e-7, rel=1e-4), step

    calls = {0: reward_calls(single)}
    for call in reward_calls(ddp):
        calls.setdefault(10 + call["rank"], []).append(call)
    assert sorted(calls) == [0, 10, 11] and [len(c) for c in calls.values()] == [2, 2, 2]
    for run, per_call in calls.items():
        for call in per_call:
            assert len(call["texts"]) == (8 if run == 0 else 4), run
            assert call["image_colours"] == [[c] for c in call["colours"]], run
            lengths = [len(t) for t in call["texts"]]  # the rewards of some prompt's two completions differ
            assert any(a != b for a, b in zip(lengths[::2], lengths[1::2], strict=True)), run
    for step in range(2):  # the same completion for the same image, whichever process generated it
        one = sorted(zip(calls[0][step]["colours"], calls[0][step]["texts"], strict=True))
        two = sorted(
            pair
            for rank in (10, 11)
            for pair in zip(calls[rank][step]["colours"], calls[rank][step]["texts"], strict=True)
        )
        assert one == two, step
        assert sorted(calls[0][step]["colours"]) == ["blue", "blue", "green", "green", "red", "red", "red", "red"]
    a, b = final_weights(single / "out"), final_weights(ddp / "out")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=1e-4)


def test_seeded_sampling_cuts_a_batchs_qwen_vision_inputs_into_each_rows_own():
    """tests/grpo_seeded_run.py generates one row at a time: a left-padded batch of a row with one image, one with
    none and one with two gets, per row, its unpadded per-token inputs and the patches and grid rows of its own
    images; an input it does not know how to cut is refused."""
    from types import SimpleNamespace

    from tests.grpo_seeded_run import rows_vision_inputs

    config = SimpleNamespace(image_token_id=9, vision_config=SimpleNamespace(spatial_merge_size=2))
    ids = torch.tensor([[0, 0, 0, 0, 5, 9, 9, 9, 9, 6], [0, 0, 0, 0, 0, 0, 0, 0, 5, 6], [5, 9, 9, 6, 9, 9, 9, 9, 5, 6]])
    mask = (torch.arange(10) >= torch.tensor([[4], [8], [0]])).long()
    grid = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4]])  # 16, 8 and 16 patches: 4, 2 and 4 image tokens
    pixels = torch.arange(40.0)[:, None]
    vision = {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": (ids == 9).long()}
    rows = rows_vision_inputs(config, ids, mask, vision)
    assert [sorted(row) for row in rows] == [sorted(vision), ["mm_token_type_ids"], sorted(vision)]
    assert torch.equal(rows[0]["pixel_values"], pixels[:16]) and torch.equal(rows[2]["pixel_values"], pixels[16:])
    assert rows[0]["image_grid_thw"].tolist() == [[1, 4, 4]] and rows[2]["image_grid_thw"].tolist() == grid[1:].tolist()
    assert [row["mm_token_type_ids"].tolist() for row in rows] == [
        [[0, 1, 1, 1, 1, 0]],
        [[0, 0]],
        [(ids[2] == 9).tolist()],
    ]
    for bad in ({"pixel_values_videos": pixels}, {"pixel_values": pixels}, {"image_sizes": grid}):
        with pytest.raises(NotImplementedError, match="cannot cut"):
            rows_vision_inputs(config, ids, mask, bad)
    with pytest.raises(ValueError, match="do not add up"):
        rows_vision_inputs(config, ids, mask, {**vision, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]])})


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
