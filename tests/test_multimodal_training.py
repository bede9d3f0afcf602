"""Vision-language training end to end on the built-in tiny VLMs (CPU, fp32): the bundled coloured-squares task is
learnt from the image, adapters land where they should, and the training invariants (activation checkpointing,
gradient accumulation, frozen vision modules, text-only rows, exact resume) hold for the multimodal path."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.conftest import EXAMPLES, write_jsonl
from tests.test_training import StepSnapshot, final_weights, logged_losses

SHAPES_DATA = EXAMPLES / "data" / "shapes.jsonl"
CHAT_DATA = EXAMPLES / "data" / "chat.jsonl"
GEMMA4 = "hellbender/tiny-gemma4-vlm"
QWEN = "hellbender/tiny-qwen2.5-vl"
LLAVA = "hellbender/tiny-llava"
IDEFICS3 = "hellbender/tiny-idefics3"
# The colours of the bundled dataset, as scripts/make_example_data.py draws them.
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220)}
# Where each tiny model keeps its language model, and names that only its vision side / projector uses.
LANGUAGE_MODEL = {
    GEMMA4: "model.language_model.",
    QWEN: "model.language_model.",
    LLAVA: "model.language_model.",
    IDEFICS3: "model.text_model.",
}
VISION_PARTS = ("vision_tower", "embed_vision", "visual", "multi_modal_projector", "connector", "vision_model")


def vlm_config(tmp_path: Path, base_model: str, **overrides) -> dict:
    cfg = {
        "base_model": base_model,
        "processor_type": "AutoProcessor",
        "datasets": [{"path": str(SHAPES_DATA), "type": "chat_template"}],
        "sequence_len": 256,
        "micro_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "bf16": False,
        "output_dir": str(tmp_path / "out"),
        "dataset_prepared_path": str(tmp_path / "prepared"),
    }
    cfg.update(overrides)
    return cfg


def model_dir(name: str) -> Path:
    from hellbender.models.tiny import tiny_model_dir

    return Path(name) if Path(name).is_dir() else tiny_model_dir(name)


def square(colour: str, x: int, y: int):
    """A held-out image drawn like the bundled ones: a 16x16 square of `colour` on white, 32x32 pixels."""
    from PIL import Image

    img = Image.new("RGB", (32, 32), (255, 255, 255))
    img.paste(COLOURS[colour], (x, y, x + 16, y + 16))
    return img


def cli_train(tmp_path: Path, cfg: dict) -> None:
    from typer.testing import CliRunner

    from hellbender.cli import app

    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output


def load_trained(cfg: dict):
    """The processor hellbender trained with, and base model + saved adapter loaded with plain transformers / PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from hellbender.models.loading import load_tokenizer_and_processor

    _, processor = load_tokenizer_and_processor(validate_config(cfg))
    base = AutoModelForImageTextToText.from_pretrained(model_dir(cfg["base_model"]), dtype=torch.float32)
    return processor, PeftModel.from_pretrained(base, cfg["output_dir"]).eval()


@torch.no_grad()
def colour_scores(model, processor, image) -> torch.Tensor:
    """Log-probability of the answer "The square is <colour>." for each colour, given `image`."""
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}
    prompt = processor.apply_chat_template([question], tokenize=False, add_generation_prompt=True)
    texts = [
        processor.apply_chat_template(
            [question, {"role": "assistant", "content": [{"type": "text", "text": f"The square is {c}."}]}],
            tokenize=False,
        )
        for c in COLOURS
    ]
    assert all(t.startswith(prompt) for t in texts)
    kwargs = dict(padding=True, add_special_tokens=False, return_tensors="pt")
    prompt_len = processor(text=[prompt], images=[[image]], **kwargs)["input_ids"].shape[1]
    batch = processor(text=texts, images=[[image]] * len(texts), **kwargs)
    logprobs = torch.log_softmax(model(**batch).logits[:, :-1].float(), -1)
    token_lp = logprobs.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    answer = batch["attention_mask"][:, 1:].clone()
    answer[:, : prompt_len - 1] = 0  # only the answer's tokens count
    return (token_lp * answer).sum(1)


@pytest.fixture(scope="module")
def seeing_gemma4(tmp_path_factory) -> Path:
    """The built-in tiny Gemma 4 with its patch projection scaled up 200x (nothing else changed).

    At its random initialisation the tiny Gemma 4 vision tower is nearly colour-blind: the patch projection
    (std 0.02) is dwarfed by the position-embedding table (std 1), and the image features of a red and a blue square
    differ by about 0.5 %, so within this file's time budget LoRA cannot learn the colour from them (the model only
    learns the colour prior). Scaling the projection makes the pixels visible; architecture and code path are the same.
    """
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("seeing-gemma4")
    shutil.copytree(model_dir(GEMMA4), target, dirs_exist_ok=True)
    weights = load_file(target / "model.safetensors")
    weights["model.vision_tower.patch_embedder.input_proj.weight"] *= 200
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


# --- 1. the image task is learnt, from the image ------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, steps, learning_rate, modules_to_save, all_correct",
    [
        # Gemma 4 learns to tell the colours apart by 100 steps; beating the colour prior for the rarest colour (blue,
        # 14 of 60 rows) takes ~150 steps on some seeds, so only the image-dependence and above-chance accuracy are
        # asserted (strict per-image argmax was 12/12 on 4 of 6 seeds tried).
        ("gemma4", 100, 1.5e-3, ["embed_tokens", "lm_head", "embed_vision"], False),
        ("qwen2.5-vl", 150, 3e-3, ["embed_tokens", "lm_head"], True),
    ],
)
def test_vlm_learns_the_colour_of_the_square_from_the_image(
    tmp_path, request, family, steps, learning_rate, modules_to_save, all_correct
):
    base_model = str(request.getfixturevalue("seeing_gemma4")) if family == "gemma4" else QWEN
    cfg = vlm_config(
        tmp_path,
        base_model,
        adapter="lora",
        lora_r=16,
        lora_alpha=32,
        lora_target_linear=True,
        lora_modules_to_save=modules_to_save,
        max_steps=steps,
        learning_rate=learning_rate,
        save_steps=1000,  # no intermediate checkpoints (time)
    )
    cli_train(tmp_path, cfg)
    losses = list(logged_losses(cfg["output_dir"]).values())
    assert len(losses) == steps
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.1 * first, losses

    processor, model = load_trained(cfg)
    rng = random.Random(1234)
    held_out = [(c, square(c, rng.randint(0, 16), rng.randint(0, 16))) for c in COLOURS for _ in range(4)]
    scores = {i: colour_scores(model, processor, image) for i, (_, image) in enumerate(held_out)}
    names = list(COLOURS)
    truth = {i: names.index(c) for i, (c, _) in enumerate(held_out)}
    # The image decides: each colour word is more likely on every image of that colour than on any other image. A
    # model that ignored the image would give every image the same scores and fail this.
    for w, word in enumerate(names):
        own = [scores[i][w].item() for i in scores if truth[i] == w]
        other = [scores[i][w].item() for i in scores if truth[i] != w]
        assert min(own) > max(other) + 0.2, (word, own, other)
    correct = sum(int(scores[i].argmax()) == truth[i] for i in scores)
    # Chance is 4 of 12; an image-blind model answers the same colour for all 12, i.e. exactly 4.
    assert correct >= (12 if all_correct else 8), {i: scores[i].tolist() for i in scores}
