"""`tokenizer_use_mistral_common` with `processor_type`: Mistral 3 vision rows encoded by mistral-common (its image
tokens and its image preprocessing), labelled like text rows with mistral-common, batched into the pixel layout
transformers' Mistral 3 model reads, and trained end to end.

The model is a tiny `Mistral3ForConditionalGeneration` (Pixtral vision tower, patch 4, spatial merge 2) built from
a config, beside a byte-level tekken file with an `image` section of the same patch and merge sizes: one `[IMG]`
token per 8 x 8 pixels, each row of them closed by `[IMG_BREAK]`, the last by `[IMG_END]`. Expected ids are written
out by hand (byte b is id `N_SPECIAL + b`), independently of mistral-common.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("mistral_common")
pytest.importorskip("cv2")  # mistral-common[image]; the `mistral` extra and the dev extra install it

from PIL import Image  # noqa: E402

from hellbender.config import validate_config  # noqa: E402
from hellbender.data.batching import build_collator  # noqa: E402
from hellbender.data.contexts import format_context  # noqa: E402
from hellbender.data.formats import FORMATTERS, RowError  # noqa: E402
from hellbender.data.prepare import prepare_datasets  # noqa: E402
from hellbender.errors import ConfigError, DataError  # noqa: E402
from hellbender.models.loading import load_tokenizer_and_processor  # noqa: E402
from tests.helpers import SHAPES_DATA, cli_train, logged_losses, vlm_config  # noqa: E402
from tests.test_mistral_common import BOS, END_INST, EOS, INST, N_SPECIAL, SPECIALS, b, write_tekken  # noqa: E402

IGNORE = -100
IMG, IMG_BREAK, IMG_END = (SPECIALS.index(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
PATCH, MERGE, MAX_IMAGE = 4, 2, 32
PIXELS_PER_TOKEN = PATCH * MERGE  # 8


def image_tokens(width_tokens: int, height_tokens: int) -> list[int]:
    rows = ([IMG] * width_tokens + [IMG_BREAK]) * height_tokens
    return rows[:-1] + [IMG_END]


def build_tiny_mistral3(target: Path) -> Path:
    """A tiny Mistral 3 vision model with its tekken.json (image section included), saved like a hub checkpoint."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    write_tekken(target, "v7")
    tekken = json.loads((target / "tekken.json").read_text())
    tekken["image"] = {"image_patch_size": PATCH, "max_image_size": MAX_IMAGE, "spatial_merge_size": MERGE}
    (target / "tekken.json").write_text(json.dumps(tekken))
    vision = PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=8,
        image_size=MAX_IMAGE,
        patch_size=PATCH,
    )
    text = MistralConfig(
        vocab_size=N_SPECIAL + 256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=SPECIALS.index("<pad>"),
        tie_word_embeddings=False,
    )
    config = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Mistral3ForConditionalGeneration(config).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def tiny_mistral3(tmp_path_factory) -> Path:
    return build_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))


def raw_config(tmp_path: Path, model: Path, **overrides) -> dict:
    return vlm_config(tmp_path, str(model), tokenizer_use_mistral_common=True, **overrides)


def write_image(path: Path, size: tuple[int, int], colour: tuple[int, int, int] = (255, 0, 0)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return str(path)


def encode(tmp_path: Path, model: Path, messages: list[dict], **entry) -> dict:
    cfg = validate_config(
        raw_config(
            tmp_path,
            model,
            datasets=[{"path": str(SHAPES_DATA), "type": "chat_template", "image_base_dir": str(tmp_path), **entry}],
        )
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    ctx = format_context(cfg.datasets[0], cfg, tokenizer, processor)
    return FORMATTERS["multimodal_chat"]({"messages": messages}, ctx)


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return str(info.value)


# --- validation and loading ---------------------------------------------------------------------------------------


def test_a_vision_config_with_mistral_common_is_accepted(tmp_path, tiny_mistral3):
    cfg = validate_config(raw_config(tmp_path, tiny_mistral3))
    assert cfg.tokenizer_use_mistral_common and cfg.is_multimodal


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"processor_type": "PixtralProcessor"}, "`processor_type: PixtralProcessor` would be ignored"),
        ({"processor_type": "VoxtralProcessor"}, "audio models such as Voxtral are not supported yet"),
        (
            {"datasets": [{"path": "c.jsonl", "type": "chat_template", "image_token": "[IMG]"}]},
            "`image_token` cannot apply",
        ),
        (
            {"datasets": [{"path": "c.jsonl", "type": "multimodal_pretrain"}]},
            "raw image+text (`multimodal_pretrain`, `pretraining_dataset`) cannot be encoded",
        ),
    ],
)
def test_vision_settings_mistral_common_cannot_honour_are_refused(tmp_path, tiny_mistral3, changes, needle):
    assert needle in error_of(raw_config(tmp_path, tiny_mistral3, **changes))


def test_without_opencv_validation_says_how_to_install_it(tmp_path, tiny_mistral3, monkeypatch):
    import hellbender.config.mistral_common as check

    real = check.util.find_spec
    monkeypatch.setattr(check.util, "find_spec", lambda name: None if name == "cv2" else real(name))
    message = error_of(raw_config(tmp_path, tiny_mistral3))
    assert "OpenCV is not installed" in message and "pip install 'hellbender[mistral]'" in message


def test_a_text_models_tokenizer_file_is_refused_for_images(tmp_path, tiny_mistral3):
    cfg = validate_config(raw_config(tmp_path, tiny_mistral3, tokenizer_config=str(write_tekken(tmp_path / "text"))))
    with pytest.raises(ConfigError, match="has no image settings"):
        load_tokenizer_and_processor(cfg)


# --- rows ---------------------------------------------------------------------------------------------------------


def test_images_become_mistral_common_tokens_and_only_the_answer_is_trained(tmp_path, tiny_mistral3):
    wide = write_image(tmp_path / "img" / "wide.png", (20, 12))  # 3 x 2 tokens of 8 x 8 pixels
    tall = write_image(tmp_path / "img" / "tall.png", (9, 30))  # 2 x 4
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "image", "path": wide}, {"type": "text", "text": "Hue?"}]},
        {"role": "assistant", "content": "Red"},
        {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "image", "path": tall}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red too"}]},
    ]
    row = encode(tmp_path, tiny_mistral3, messages)
    sys_, end_sys = SPECIALS.index("[SYSTEM_PROMPT]"), SPECIALS.index("[/SYSTEM_PROMPT]")
    prompt1 = [BOS, sys_, *b("Be terse."), end_sys, INST, *image_tokens(3, 2), *b("Hue?"), END_INST]
    # mistral-common's instruct format puts a user turn's images before its text, wherever the parts stood.
    prompt2 = [INST, *image_tokens(2, 4), *b("And"), END_INST]
    assert row["input_ids"] == [*prompt1, *b("Red"), EOS, *prompt2, *b("Red too"), EOS]
    masked = [IGNORE] * len(prompt1), [IGNORE] * len(prompt2)
    assert row["labels"] == [*masked[0], *b("Red"), EOS, *masked[1], *b("Red too"), EOS]
    assert row["images"] == [str(Path(wide).resolve()), str(Path(tall).resolve())]


def test_train_on_inputs_trains_the_text_but_never_an_image_token(tmp_path, tiny_mistral3):
    image = write_image(tmp_path / "img" / "a.png", (16, 8))
    messages = [
        {"role": "user", "content": [{"type": "image", "path": image}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Yo"},
    ]
    row = encode(tmp_path, tiny_mistral3, messages, train_on_inputs=True)
    assert row["input_ids"] == [BOS, INST, *image_tokens(2, 1), *b("Hi"), END_INST, *b("Yo"), EOS]
    assert row["labels"] == [BOS, INST, IGNORE, IGNORE, IGNORE, *b("Hi"), END_INST, *b("Yo"), EOS]


def test_an_image_outside_a_user_turn_is_a_row_error(tmp_path, tiny_mistral3):
    image = write_image(tmp_path / "img" / "a.png", (8, 8))
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "image", "path": image}, {"type": "text", "text": "Yo"}]},
    ]
    with pytest.raises(RowError, match="takes images in user turns"):
        encode(tmp_path, tiny_mistral3, messages)


# --- batches and the model ----------------------------------------------------------------------------------------


def _rows_and_batch(tmp_path: Path, model: Path, **overrides):
    sizes = [(20, 12), (9, 30), (32, 32)]
    lines = []
    for i, size in enumerate(sizes):
        path = write_image(tmp_path / "data" / f"{i}.png", size, (40 * i, 200, 0))
        user = [{"type": "image", "path": Path(path).name}, {"type": "text", "text": "Colour?"}]
        lines.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"c{i}"}]})
    data = tmp_path / "data" / "rows.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = validate_config(
        raw_config(tmp_path, model, datasets=[{"path": str(data), "type": "chat_template"}], **overrides)
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    rows = list(prepare_datasets(cfg, tokenizer, processor).train)
    return cfg, processor, rows, build_collator(cfg, tokenizer, processor)(rows)


def test_a_batch_holds_each_images_pixels_padded_and_its_size(tmp_path, tiny_mistral3):
    _, processor, rows, batch = _rows_and_batch(tmp_path, tiny_mistral3)
    # (height, width), each side rounded up to whole 8-pixel tokens; rows come shuffled, images in row order.
    assert sorted(batch["image_sizes"].tolist()) == [[16, 24], [32, 16], [32, 32]]
    assert tuple(batch["pixel_values"].shape) == (3, 3, 32, 32)
    for i, row in enumerate(rows):
        _, expected = processor.encode_image(Image.open(row["images"][0]).convert("RGB"))
        height, width = batch["image_sizes"][i].tolist()
        assert expected.shape[1:] == (height, width)
        assert batch["pixel_values"][i, :, :height, :width].numpy() == pytest.approx(expected)
        assert not batch["pixel_values"][i, :, height:].any() and not batch["pixel_values"][i, :, :, width:].any()
    assert batch["attention_mask"].sum().item() == sum(len(r["input_ids"]) for r in rows)


def test_the_models_vision_tower_fills_every_image_token_and_the_loss_is_finite(tmp_path, tiny_mistral3):
    import torch
    from transformers import Mistral3ForConditionalGeneration

    _, _, rows, batch = _rows_and_batch(tmp_path, tiny_mistral3)
    model = Mistral3ForConditionalGeneration.from_pretrained(tiny_mistral3)
    batch.pop("num_real_tokens")
    with torch.no_grad():
        features = model.get_image_features(
            pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"]
        ).pooler_output
        out = model(**batch)
    assert sum(f.shape[0] for f in features) == (batch["input_ids"] == IMG).sum().item() == 6 + 8 + 16
    assert math.isfinite(out.loss.item())
    trained = [t for r in rows for t, label in zip(r["input_ids"], r["labels"], strict=True) if label != IGNORE]
    assert sorted(trained) == sorted([*b("c0"), EOS, *b("c1"), EOS, *b("c2"), EOS])


def test_a_changed_image_is_caught_at_batch_time(tmp_path, tiny_mistral3):
    cfg, processor, rows, _ = _rows_and_batch(tmp_path, tiny_mistral3)
    Image.new("RGB", (32, 8)).save(tmp_path / "data" / "0.png")  # other size: other image tokens
    with pytest.raises(DataError, match="encodes the images of a prepared row into other image tokens"):
        build_collator(cfg, processor.tokenizer, processor)(rows)


def test_cached_images_give_the_same_batch_without_the_files(tmp_path, tiny_mistral3):
    cfg, processor, rows, batch = _rows_and_batch(tmp_path, tiny_mistral3, cache_images=True)
    for image in (tmp_path / "data").glob("*.png"):
        image.unlink()
    again = build_collator(cfg, processor.tokenizer, processor)(rows)
    assert again["pixel_values"].equal(batch["pixel_values"]) and again["image_sizes"].equal(batch["image_sizes"])


def test_infer_refuses_a_mistral_common_vision_run(tmp_path, tiny_mistral3):
    from hellbender.errors import UserError
    from hellbender.use.inference import Generator

    with pytest.raises(UserError, match="not supported yet"):
        Generator(validate_config(raw_config(tmp_path, tiny_mistral3)))


def test_a_tiny_mistral3_trains_on_mistral_common_image_rows(tmp_path, tiny_mistral3):
    cfg = raw_config(tmp_path, tiny_mistral3, max_steps=12, learning_rate=3e-3, save_steps=1000)
    cli_train(tmp_path, cfg)
    losses = list(logged_losses(cfg["output_dir"]).values())
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    out = Path(cfg["output_dir"])
    assert (out / "tekken.json").read_bytes() == (tiny_mistral3 / "tekken.json").read_bytes()
