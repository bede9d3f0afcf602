"""Multimodal continued pretraining (`type: multimodal_pretrain`): raw image+text documents, prepared, pre-tokenized
or streamed, on the built-in tiny VLMs (CPU, fp32). Images are drawn in code; every row has its own image file, so
counting the files opened tells exactly which rows' images were touched."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import load_config, validate_config
from hellbender.data.contexts import format_context, image_policy
from hellbender.data.formats.base import RowDropped, RowError, RowTooLong
from hellbender.data.formats.multimodal_pretrain import tokenize_row
from hellbender.data.prepare import prepare_datasets, training_entries
from hellbender.errors import ConfigError, DataError
from hellbender.models.tiny import tiny_model_dir
from tests.conftest import REPO, write_jsonl
from tests.helpers import base_config, cli_train, final_weights, logged_losses, record_training, trainer_state
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN

FAMILIES = [QWEN, GEMMA4, LLAVA, IDEFICS3]
# How each family's documents mark an image (Qwen2.5-VL wraps its image token in vision markers).
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TEXT = {QWEN: QWEN_IMAGE, GEMMA4: "<image_soft_token>", LLAVA: "<image>", IDEFICS3: "<image>"}
IGNORE = -100
COLOURS = ["red", "green", "blue", "yellow"]
RGB = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (220, 220, 30)}
N_IMAGES = 16


def image_name(i: int) -> str:
    return f"img/{i:02d}.png"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """N_IMAGES distinct 32x32 images (a 16x16 square of one colour, at a position that differs per image)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("mm-cpt-images")
    (root / "img").mkdir()
    for i in range(N_IMAGES):
        img = Image.new("RGB", (32, 32), (255, 255, 255))
        x, y = i % 8 * 2, i // 8 * 8
        img.paste(RGB[COLOURS[i % 4]], (x, y, x + 16, y + 16))
        img.save(root / image_name(i))
    return root


def document(i: int) -> dict:
    """Raw CPT row i (Qwen2.5-VL image syntax): one image (image i) and a sentence about it."""
    return {"text": f"{QWEN_IMAGE}Square {i} is {COLOURS[i % 4]}.", "images": [image_name(i)]}


def entry(path: Path, images: Path, **keys) -> dict:
    return {"path": str(path), "ds_type": "json", "type": "multimodal_pretrain", "image_base_dir": str(images), **keys}


def mm_config(tmp_path: Path, **overrides) -> dict:
    """A LoRA run of the tiny Qwen2.5-VL; the data (and, for streams, max_steps) come from `overrides`."""
    defaults = dict(
        base_model=QWEN,
        processor_type="AutoProcessor",
        datasets=[],
        max_steps=None,
        sequence_len=256,
        micro_batch_size=2,
        adapter="lora",
        lora_target_linear=True,
    )
    return base_config(tmp_path, **{**defaults, **overrides})


def fresh(model: str):
    """(tokenizer, processor) of a tiny VLM, loaded the way `train` loads them."""
    from hellbender.models.loading import load_tokenizer_and_processor

    cfg = validate_config(
        {
            "base_model": model,
            "processor_type": "AutoProcessor",
            "datasets": [{"path": "x", "type": "multimodal_pretrain"}],
        }
    )
    return load_tokenizer_and_processor(cfg)


@functools.cache
def loaded(model: str):
    """`fresh(model)`, shared by the tests here. Collating a batch leaves padding switched on in the tokenizer's
    backend, which the prepared-data cache key hashes, so tests of the cache key load their own."""
    return fresh(model)


def encoder(model: str, images: Path, sequence_len: int = 256, **entry_keys):
    """The format context `prepare_datasets` gives a `multimodal_pretrain` entry of `model`."""
    raw = mm_config(images, base_model=model, sequence_len=sequence_len)
    raw["datasets"] = [entry(images / "rows.jsonl", images, **entry_keys)]
    cfg = validate_config(raw)
    tok, proc = loaded(model)
    return format_context(training_entries(cfg)[0], cfg, tok, proc)


def ids(model: str, text: str) -> list[int]:
    return loaded(model)[0](text, add_special_tokens=False)["input_ids"]


def expansion(model: str, images: Path, image_text: str, n: int = 0) -> list[int]:
    """The processor's own tokens for one image written as `image_text` (image n)."""
    from PIL import Image

    _, proc = loaded(model)
    with Image.open(images / image_name(n)) as img:
        out = proc(text=[image_text], images=[[img.convert("RGB")]], add_special_tokens=False)
    return list(out["input_ids"][0])


def cli(args: list[str]):
    from typer.testing import CliRunner

    from hellbender.cli import app

    return CliRunner().invoke(app, args)


def token_counters(output_dir: str | Path) -> dict:
    return trainer_state(output_dir)["stateful_callbacks"]["TokenCounter"]["attributes"]


# ---------------------------------------------------------------------------------------------------------------
# The encoder: one raw row -> expanded tokens and labels


def test_image_tokens_are_counted_by_id_against_the_images(images):
    ctx = encoder(QWEN, images)
    two_tokens = {"text": f"{QWEN_IMAGE}A red square. {QWEN_IMAGE}", "images": [image_name(0)]}
    with pytest.raises(RowError, match=r"2 image token\(s\) `<\|image_pad\|>` but the row has 1 image\(s\)"):
        tokenize_row(two_tokens, ctx)
    two_images = {"text": f"{QWEN_IMAGE}A red square.", "images": [image_name(0), image_name(1)]}
    with pytest.raises(RowError, match=r"1 image token\(s\) `<\|image_pad\|>` but the row has 2 image\(s\)"):
        tokenize_row(two_images, ctx)
    no_token = {"text": "A red square.", "images": [image_name(0)]}
    with pytest.raises(RowError, match=r"0 image token\(s\)"):
        tokenize_row(no_token, ctx)


def test_gemma4_plain_text_image_tag_is_text_and_not_an_image(images):
    """`<image>` is plain text for Gemma 4 (its image token is `<image_soft_token>`). A count of the substring
    `<image>` would find 2 images here; counting the image token's id finds the one there is."""
    prefix = "<image> and <image> are tags. "
    text = prefix + "<image_soft_token>A red square."
    assert text.count("<image>") == 2
    ctx = encoder(GEMMA4, images)
    out = tokenize_row({"text": text, "images": [image_name(0)]}, ctx)

    tok, _ = loaded(GEMMA4)
    image = expansion(GEMMA4, images, "<image_soft_token>")
    suffix = ids(GEMMA4, "A red square.") + [tok.eos_token_id]
    assert len(image) > 2 and set(image) <= ctx.vision.vision_ids
    assert out["input_ids"] == ids(GEMMA4, prefix) + image + suffix
    assert out["labels"] == ids(GEMMA4, prefix) + [IGNORE] * len(image) + suffix  # the tags are trained as text

    with pytest.raises(RowError, match=r"1 image token\(s\) `<image_soft_token>` but the row has 2 image\(s\)"):
        tokenize_row({"text": text, "images": [image_name(0), image_name(1)]}, ctx)


def test_eos_is_appended_exactly_once(images):
    ctx = encoder(QWEN, images)
    tok, _ = loaded(QWEN)
    plain = tokenize_row(document(0), ctx)
    ended = tokenize_row({**document(0), "text": document(0)["text"] + tok.eos_token}, ctx)

    assert plain["input_ids"][-1] == plain["labels"][-1] == tok.eos_token_id  # EOS is trained: documents end
    assert plain["input_ids"].count(tok.eos_token_id) == 1
    assert ended == plain
    assert plain["text"] == document(0)["text"] + tok.eos_token


def test_labels_of_a_qwen_document_exactly(images):
    """Text, image, text: every text token and the EOS are trained; the vision markers and soft tokens are not.
    A 32x32 image becomes 4 `<|image_pad|>` soft tokens in the tiny Qwen2.5-VL."""
    tok, _ = loaded(QWEN)
    start, pad, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    row = {"text": f"A picture: {QWEN_IMAGE} a red square.", "images": [image_name(0)]}
    out = tokenize_row(row, encoder(QWEN, images))

    before, after = ids(QWEN, "A picture: "), ids(QWEN, " a red square.") + [tok.eos_token_id]
    assert out["input_ids"] == before + [start] + [pad] * 4 + [end] + after
    assert out["labels"] == before + [IGNORE] * 6 + after
    assert out["images"] == [str((images / image_name(0)).resolve())]


@pytest.mark.parametrize("model", FAMILIES)
def test_every_text_token_is_trained_and_no_token_of_the_image_expansion(images, model):
    """The same document in each family: the tokens of the image's expansion (as the processor expands the image
    alone: placeholders, soft tokens, begin/end markers, tile markers and the layout between tiles) are never
    trained; the text around them and the EOS are."""
    tok, _ = loaded(model)
    image = expansion(model, images, IMAGE_TEXT[model])
    row = {"text": f"A picture: {IMAGE_TEXT[model]} a red square.", "images": [image_name(0)]}
    out = tokenize_row(row, encoder(model, images))

    before, after = ids(model, "A picture: "), ids(model, " a red square.") + [tok.eos_token_id]
    assert out["input_ids"] == before + image + after
    inside = out["labels"][len(before) : len(before) + len(image)]
    trained_inside = [tok.convert_ids_to_tokens(t) for t, label in zip(image, inside, strict=True) if label != IGNORE]
    assert trained_inside == [], "tokens of the image's expansion are trained"
    assert out["labels"] == before + [IGNORE] * len(image) + after


def test_row_longer_than_sequence_len_is_dropped_or_refused_never_truncated(images):
    n = len(tokenize_row(document(0), encoder(QWEN, images))["input_ids"])
    assert tokenize_row(document(0), encoder(QWEN, images, sequence_len=n))["input_ids"]  # exactly n fits

    # Found before the image is decoded, for `excess_length_strategy` to drop or refuse (`encode_row`); never cut.
    with pytest.raises(RowTooLong) as found:
        tokenize_row(document(0), encoder(QWEN, images, sequence_len=n - 1))
    assert n - 1 < found.value.tokens <= n
    with pytest.raises(RowDropped, match="^longer than sequence_len$"):
        tokenize_row(document(0), encoder(QWEN, images, sequence_len=n - 1, skip_bad_images=True))


def test_over_long_row_is_dropped_and_counted_or_named_by_its_index(tmp_path, images):
    long = {"text": QWEN_IMAGE + " ".join(["A red square on a white background."] * 4), "images": [image_name(1)]}
    rows = write_jsonl(tmp_path / "rows.jsonl", [document(0), long, document(2)])
    tok, proc = loaded(QWEN)

    cfg = mm_config(tmp_path, sequence_len=40, datasets=[entry(rows, images)], excess_length_strategy="raise")
    # Found from the text and the image's size, before the image is decoded: a lower bound on its length.
    with pytest.raises(
        DataError, match=r"row 1: at least \d+ tokens with its images expanded, more than `sequence_len: 40`"
    ):
        prepare_datasets(validate_config(cfg), tok, proc)

    for keys in ({"excess_length_strategy": "drop"}, {"datasets": [entry(rows, images, skip_bad_images=True)]}):
        changed = {**mm_config(tmp_path, sequence_len=40, datasets=[entry(rows, images)]), **keys}
        stats = prepare_datasets(validate_config(changed), tok, proc).stats["train"]
        assert (stats["rows_kept"], stats["rows_dropped"]) == (2, {"longer than sequence_len": 1})


def test_image_token_override_must_be_a_special_token(images):
    """Gemma 3 style documents mark images with the begin-of-image token; `image_token` names it."""
    out = tokenize_row(
        {"text": "<start_of_image>A red square.", "images": [image_name(0)]},
        encoder(GEMMA4, images, image_token="<start_of_image>"),
    )
    default = tokenize_row(
        {"text": "<image_soft_token>A red square.", "images": [image_name(0)]}, encoder(GEMMA4, images)
    )
    assert (out["input_ids"], out["labels"]) == (default["input_ids"], default["labels"])
    with pytest.raises(RowError, match=r"0 image token\(s\) `<start_of_image>`"):
        tokenize_row(
            {"text": "<image_soft_token>A red square.", "images": [image_name(0)]},
            encoder(GEMMA4, images, image_token="<start_of_image>"),
        )

    with pytest.raises(ConfigError, match=r"`image_token: <image>` is not a special token of the tokenizer"):
        encoder(GEMMA4, images, image_token="<image>")  # plain text for Gemma 4


# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenized rows (`skip_prepare_dataset`) get the same labels as prepared ones


def pretokenized_row(model: str, raw: dict, padding: int = 0) -> dict:
    """A row as a user's own pipeline writes it: the tokenizer's tokens of `_mm_text` (images not expanded), labels
    copied from the ids, and right padding with EOS as the pad token (common in CPT), masked only by the
    attention mask."""
    tok, _ = loaded(model)
    text = raw["text"] + tok.eos_token
    row_ids = ids(model, text)
    pad = [tok.eos_token_id] * padding
    return {
        "_mm_text": text,
        "images": raw["images"],
        "input_ids": row_ids + pad,
        "attention_mask": [1] * len(row_ids) + [0] * padding,
        "labels": row_ids + pad,
    }


@pytest.mark.parametrize("model", FAMILIES)
def test_collator_gives_pretokenized_rows_the_labels_of_prepared_rows(tmp_path, images, model):
    from hellbender.data.multimodal_collator import MultimodalCollator
    from hellbender.data.pretokenized_multimodal import pretokenized_multimodal_rows
    from hellbender.data.vision_tokens import vision_token_ids

    tok, proc = loaded(model)
    image = IMAGE_TEXT[model]
    raw = [
        {"text": f"Look: {image} a red square, then {image}a green one.", "images": [image_name(0), image_name(1)]},
        {"text": f"{image}Blue.", "images": [image_name(2)]},
    ]
    raw_file = write_jsonl(tmp_path / "raw.jsonl", raw)
    cfg = validate_config(
        mm_config(tmp_path, base_model=model, datasets=[entry(raw_file, images)], shuffle_merged_datasets=False)
    )
    prepared = prepare_datasets(cfg, tok, proc).train
    pre_file = write_jsonl(tmp_path / "pre.jsonl", [pretokenized_row(model, r, padding=3) for r in raw])
    pre_cfg = validate_config(
        mm_config(tmp_path, base_model=model, datasets=[entry(pre_file, images)], skip_prepare_dataset=True)
    )
    pretokenized = pretokenized_multimodal_rows(pre_cfg)
    collate = MultimodalCollator(proc, image_policy(cfg), frozenset(vision_token_ids(proc, [])))

    want = collate([dict(r) for r in prepared])
    got = collate([pretokenized[0], pretokenized[1]])
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert got["labels"].tolist() == want["labels"].tolist()
    # The short row's padding is never trained, and its one real EOS is.
    short = got["labels"][1]
    n = int(got["attention_mask"][1].sum())
    assert (short[n:] == IGNORE).all() and short[n - 1] == tok.eos_token_id
    assert not set(got["labels"].flatten().tolist()) & collate.vision_ids


# ---------------------------------------------------------------------------------------------------------------
# End to end through `hellbender train`


@pytest.mark.parametrize(("micro_batch", "accumulation"), [(4, 1), (2, 2)])
def test_prepared_run_of_one_epoch_trains_every_row_once(tmp_path, images, micro_batch, accumulation):
    """`num_epochs: 1` and no `max_steps`: the step count comes from the prepared rows (the last batch and the
    last accumulation may be short), and every row is trained exactly once."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [document(i) for i in range(10)])
    cfg = mm_config(
        tmp_path,
        datasets=[entry(rows, images)],
        num_epochs=1,
        micro_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
    )
    cli_train(tmp_path, cfg)

    steps = math.ceil(math.ceil(10 / micro_batch) / accumulation)
    state = trainer_state(cfg["output_dir"])
    assert (state["global_step"], state["max_steps"]) == (steps, steps)
    assert state["epoch"] == pytest.approx(1.0)
    assert sorted(logged_losses(cfg["output_dir"])) == list(range(1, steps + 1))
    prepared = prepare_datasets(validate_config(cfg), *fresh(QWEN))
    assert prepared.from_cache  # train prepared exactly this
    stats = prepared.stats["train"]
    assert token_counters(cfg["output_dir"]) == {
        "input_tokens": stats["tokens"],
        "trained_tokens": stats["trainable_tokens"],
    }


def test_pretokenized_rows_train_with_their_images_expanded(tmp_path, images):
    tok, _ = loaded(QWEN)
    raw = [document(i) for i in range(4)]
    rows = write_jsonl(tmp_path / "pre.jsonl", [pretokenized_row(QWEN, r, padding=i) for i, r in enumerate(raw)])
    cfg = mm_config(tmp_path, datasets=[entry(rows, images)], skip_prepare_dataset=True, num_epochs=1)
    cli_train(tmp_path, cfg)

    assert trainer_state(cfg["output_dir"])["global_step"] == 2
    vision = set(tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]))
    unexpanded = [ids(QWEN, r["text"] + tok.eos_token) for r in raw]
    # Each row's one `<|image_pad|>` became 4; every row starts with an image, so each non-vision token is a target.
    assert token_counters(cfg["output_dir"]) == {
        "input_tokens": sum(len(r) + 3 for r in unexpanded),
        "trained_tokens": sum(sum(1 for t in r if t not in vision) for r in unexpanded),
    }
    assert not (Path(cfg["dataset_prepared_path"])).exists()  # nothing was prepared or cached


def test_test_datasets_of_the_same_modality_give_the_eval_loss(tmp_path, images):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from hellbender.data.collator import REAL_TOKENS_KEY
    from hellbender.data.multimodal_collator import MultimodalCollator
    from hellbender.data.vision_tokens import vision_token_ids
    from hellbender.models.loading import resolve_model_path
    from hellbender.train.run import train

    train_rows = write_jsonl(tmp_path / "train.jsonl", [document(i) for i in range(8)])
    eval_rows = write_jsonl(tmp_path / "eval.jsonl", [document(i) for i in range(12, 15)])
    cfg = validate_config(
        mm_config(
            tmp_path,
            datasets=[entry(train_rows, images)],
            test_datasets=[entry(eval_rows, images)],
            num_epochs=1,
            micro_batch_size=4,
            eval_steps=1,
        )
    )
    train(cfg)
    evals = [e for e in trainer_state(cfg.output_dir)["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [1, 2]

    # The last evaluation is of the saved model on the three evaluation rows (one batch), images masked.
    tok, proc = fresh(QWEN)
    prepared = prepare_datasets(cfg, tok, proc)
    assert prepared.from_cache and len(prepared.eval) == 3
    batch = MultimodalCollator(proc, image_policy(cfg), frozenset(vision_token_ids(proc, [])))(list(prepared.eval))
    batch.pop(REAL_TOKENS_KEY)
    base = AutoModelForImageTextToText.from_pretrained(resolve_model_path(QWEN), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, cfg.output_dir).eval()
    with torch.no_grad():
        loss = model(**batch).loss
    assert evals[-1]["eval_loss"] == pytest.approx(loss.item(), abs=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Streaming, and resuming a stream without touching the images of rows already trained


def test_streamed_run_trains_max_steps_cycling_through_the_data(tmp_path, images, monkeypatch):
    """`pretraining_dataset` + `streaming: true` + `max_steps` through `hellbender train`: 3 steps of 2 samples from 5
    rows, so the stream reads every row once and starts a second pass."""
    rows = write_jsonl(tmp_path / "stream.jsonl", [document(i) for i in range(5)])
    cfg = mm_config(tmp_path, pretraining_dataset=[entry(rows, images)], streaming=True, max_steps=3)
    record = record_training(monkeypatch.setattr)
    cli_train(tmp_path, cfg)

    state = trainer_state(cfg["output_dir"])
    assert state["global_step"] == 3 and sorted(logged_losses(cfg["output_dir"])) == [1, 2, 3]
    assert [batch_rows for batch_rows, _ in record["trained"]] == [[0, 1], [2, 3], [4, 5]]
    first_pass = [record["images_of_row"][str(i)] for i in range(5)]
    assert sorted(first_pass) == [[str((images / image_name(i)).resolve())] for i in range(5)]
    assert record["images_of_row"]["5"] in first_pass
    assert state["stateful_callbacks"]["StreamPosition"]["attributes"] == {"rows_consumed": 6}
    assert token_counters(cfg["output_dir"])["trained_tokens"] > 0


def test_streamed_run_resumed_in_a_new_process_continues_at_the_next_unseen_row(tmp_path, images, monkeypatch):
    rows = write_jsonl(tmp_path / "stream.jsonl", [document(i) for i in range(12)])
    common = dict(
        datasets=[],
        pretraining_dataset=[entry(rows, images)],
        streaming=True,
        max_steps=4,
        save_steps=2,
        lr_scheduler="cosine",
        warmup_steps=1,
        lora_dropout=0.1,  # exercises the restored RNG state
    )
    # The uninterrupted run, through `hellbender train` in this process. The tiny model is built first: building it
    # inside `train` reseeds torch (see test_first_run_of_a_tiny_vlm_is_reproduced_by_later_runs).
    tiny_model_dir(QWEN)
    reference = mm_config(tmp_path / "ref", **common)
    ref = record_training(monkeypatch.setattr)
    cli_train(tmp_path, reference, "ref.yml")
    monkeypatch.undo()
    assert trainer_state(reference["output_dir"])["global_step"] == 4
    load_config(Path(reference["output_dir"]) / "hellbender_config.yml")  # the resolved config reloads

    # The same run stopped after the checkpoint at step 2, then resumed to 4 by a new process.
    resumed = mm_config(tmp_path / "resumed", auto_resume_from_checkpoints=True, **common)
    config = tmp_path / "resumed.yml"
    config.write_text(yaml.safe_dump(resumed))
    runs = []
    for stop in (["--stop-at", "2"], []):
        report = tmp_path / f"report-{len(runs)}.json"
        done = subprocess.run(
            [sys.executable, "-m", "tests.stopped_run", str(config), *stop, "--record", str(report)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(report.read_text()))
    first, second = runs
    checkpoint = json.loads((Path(resumed["output_dir"]) / "checkpoint-2" / "trainer_state.json").read_text())
    assert checkpoint["stateful_callbacks"]["StreamPosition"]["attributes"] == {"rows_consumed": 4}

    # The same samples in the same order: rows 0-3 before the interruption, 4-7 after it.
    assert [batch_rows for batch_rows, _ in ref["trained"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert first["trained"] == ref["trained"][:2]
    assert second["trained"] == ref["trained"][2:]
    # Zero image loads for the rows trained before the checkpoint; the rows after it were loaded.
    seen = {str((images / image_name(i)).resolve()) for i in range(12)}
    skipped = {p for row in range(4) for p in ref["images_of_row"][str(row)]}
    trained_after = {p for row in range(4, 8) for p in ref["images_of_row"][str(row)]}
    assert len(skipped) == 4 and len(trained_after) == 4 and skipped | trained_after <= seen
    assert skipped <= set(first["opened"])  # the counter sees the opens that do happen
    assert not skipped & set(second["opened"]), sorted(skipped & set(second["opened"]))
    assert trained_after <= set(second["opened"])
    # Restored token counters.
    assert token_counters(resumed["output_dir"]) == token_counters(reference["output_dir"])
    assert token_counters(reference["output_dir"])["trained_tokens"] > 0

    # The same losses and weights: the LoRA dropout masks after the resume must be those of the uninterrupted run.
    expected = logged_losses(reference["output_dir"])
    got = logged_losses(resumed["output_dir"])
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)
    final, ref_final = final_weights(resumed["output_dir"]), final_weights(reference["output_dir"])
    assert final.keys() == ref_final.keys()
    for key in final:
        torch.testing.assert_close(final[key], ref_final[key], atol=1e-6, rtol=1e-6)


def test_first_run_of_a_tiny_vlm_is_reproduced_by_later_runs(tmp_path, images):
    """The same config and seed train the same model whether or not `train` had to build the tiny model first (a
    fresh HELLBENDER_CACHE, as on a new machine or the first quickstart run)."""
    from hellbender.train.run import train

    tiny_model_dir(QWEN)
    rows = write_jsonl(tmp_path / "stream.jsonl", [document(i) for i in range(4)])
    common = dict(pretraining_dataset=[entry(rows, images)], streaming=True, max_steps=2, save_steps=10)
    warm_cfg = validate_config(mm_config(tmp_path / "warm", **common))
    train(warm_cfg)
    warm = logged_losses(warm_cfg.output_dir), final_weights(warm_cfg.output_dir)

    cold_cfg = mm_config(tmp_path / "cold", **common)
    config = tmp_path / "cold.yml"
    config.write_text(yaml.safe_dump(cold_cfg))

    env = {**os.environ, "HELLBENDER_CACHE": str(tmp_path / "fresh-cache")}
    args = [sys.executable, "-m", "tests.stopped_run", str(config)]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "fresh-cache" / "models").is_dir()  # that run built the model
    cold = logged_losses(cold_cfg["output_dir"]), final_weights(cold_cfg["output_dir"])

    assert sorted(cold[0]) == sorted(warm[0]) == [1, 2]
    for step in warm[0]:
        assert cold[0][step] == pytest.approx(warm[0][step], abs=1e-6), (step, cold[0], warm[0])
    for key in warm[1]:
        torch.testing.assert_close(cold[1][key], warm[1][key], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# The prepared-data cache


@pytest.fixture
def count_tokenize(monkeypatch):
    import hellbender.data.prepare as prepare_module

    calls = []
    original = prepare_module.tokenize_dataset

    def counting(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "tokenize_dataset", counting)
    return calls


def test_cache_is_reused_until_the_processor_or_a_multimodal_key_changes(tmp_path, images, count_tokenize):
    tok, proc = fresh(QWEN)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    rows = write_jsonl(tmp_path / "rows.jsonl", [document(i) for i in range(3)])
    raw = mm_config(tmp_path, datasets=[entry(rows, images)])
    first = prepare_datasets(validate_config(copy.deepcopy(raw)), tok, proc)
    again = prepare_datasets(validate_config(copy.deepcopy(raw)), tok, proc)
    assert not first.from_cache and again.from_cache and again.cache_dir == first.cache_dir
    assert count_tokenize == ["multimodal_pretrain"]
    assert list(again.train) == list(first.train)

    bigger = copy.deepcopy(proc)
    bigger.image_processor.size = {"shortest_edge": 64, "longest_edge": 32 * 32}  # max_pixels 256 -> 1024
    resized = prepare_datasets(validate_config(copy.deepcopy(raw)), tok, bigger)
    assert not resized.from_cache and resized.cache_dir != first.cache_dir
    # 32x32 is no longer shrunk to 16x16: 16 soft tokens per image instead of 4.
    assert (first.train[0]["input_ids"].count(pad), resized.train[0]["input_ids"].count(pad)) == (4, 16)

    keyed = []
    for keys in ({"image_token": "<|image_pad|>"}, {"skip_bad_images": True}, {"image_column": "images"}):
        changed = copy.deepcopy(raw)
        changed["datasets"][0].update(keys)
        keyed.append(prepare_datasets(validate_config(changed), tok, proc))
    # `image_column: images` is the default: the same preparation, the same cache.
    assert [p.from_cache for p in keyed] == [False, False, True]
    assert len({first.cache_dir, keyed[0].cache_dir, keyed[1].cache_dir}) == 3
    assert len(count_tokenize) == 4


def test_processor_fingerprint_covers_the_image_tokens():
    from hellbender.data.vision_tokens import processor_fingerprint

    _, proc = loaded(GEMMA4)
    prints = {processor_fingerprint(proc)}
    for attr, value in (("image_token", "<|video|>"), ("boi_token", "<start_of_turn>")):
        changed = copy.deepcopy(proc)
        setattr(changed, attr, value)
        prints.add(processor_fingerprint(changed))
    assert processor_fingerprint(copy.deepcopy(proc)) in prints
    assert len(prints) == 3


# ---------------------------------------------------------------------------------------------------------------
# Configs that cannot work


def conflict_cases(tmp: Path) -> dict[str, tuple[dict, str]]:
    data = entry(tmp / "rows.jsonl", tmp)
    return {
        "declared twice": (
            dict(datasets=[data], pretraining_dataset=[data], streaming=False),
            f"Dataset `{data['path']}` is declared under both `datasets:` and `pretraining_dataset:`",
        ),
        "streaming a datasets entry": (
            dict(datasets=[data], streaming=True),
            "`streaming: true` streams `pretraining_dataset:` entries, but a `multimodal_pretrain` entry is under "
            "`datasets:`",
        ),
        "chat template": (
            dict(datasets=[data], chat_template="chatml"),
            "`chat_template` does not apply to `multimodal_pretrain`",
        ),
        "no processor": (
            dict(datasets=[data], processor_type=None),
            "`type: multimodal_pretrain` apply to vision-language models, and no processor is configured: set "
            "`processor_type`",
        ),
        "no processor, streamed": (
            dict(pretraining_dataset=[data], processor_type=None, max_steps=2),
            "`type: multimodal_pretrain` apply to vision-language models, and no processor is configured",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "declared twice",
        "streaming a datasets entry",
        "chat template",
        "no processor",
        "no processor, streamed",
    ],
)
def test_conflicting_multimodal_cpt_config_is_refused_naming_the_keys(tmp_path, case):
    overrides, message = conflict_cases(tmp_path)[case]
    raw = mm_config(tmp_path, **overrides)
    if raw["processor_type"] is None:
        del raw["processor_type"]
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert message in str(err.value)


def test_explicit_default_chat_template_is_accepted(tmp_path):
    """A resolved config (as `hellbender_config.yml` holds it) names `chat_template: tokenizer_default`."""
    data = entry(tmp_path / "rows.jsonl", tmp_path)
    validate_config(mm_config(tmp_path, datasets=[data], chat_template="tokenizer_default"))


def test_cross_attention_vlm_is_refused_as_unsupported(tmp_path, images):
    """Mllama feeds images through cross-attention, not image tokens in the text: refused before any work."""
    model = tmp_path / "mllama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mllama"}))
    (model / "tokenizer.json").write_text("{}")  # a checkpoint holds its tokenizer; it is never read here
    rows = write_jsonl(tmp_path / "rows.jsonl", [document(0)])
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(mm_config(tmp_path, base_model=str(model), datasets=[entry(rows, images)])))
    result = cli(["train", str(config)])
    detail = f"exit {result.exit_code}, {result.exception!r}\n{result.output}"
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), detail
    assert "Traceback" not in result.output, detail
    assert "is not supported yet as a vision-language model: Mllama" in result.output, detail
    assert "cross-attention" in result.output, detail
    assert not Path(mm_config(tmp_path)["output_dir"]).exists()


def test_streamed_rows_are_cached_and_a_rerun_encodes_none_of_them(tmp_path, images, monkeypatch):
    """The prepared stream lives under `dataset_prepared_path`: a second run over the same stream (another
    output_dir) reads every encoded row from it and opens no image while encoding; a line cut short by a kill is
    ignored; a changed setting gets another stream cache."""
    import hellbender.data.formats.multimodal_pretrain as encoder_module

    rows = write_jsonl(tmp_path / "stream.jsonl", [document(i) for i in range(6)])
    common = dict(pretraining_dataset=[entry(rows, images)], streaming=True, max_steps=3)
    opened = []
    real_open = encoder_module.open_image
    monkeypatch.setattr(
        encoder_module, "open_image", lambda path, policy: opened.append(path) or real_open(path, policy)
    )

    first = mm_config(tmp_path / "first", **common, dataset_prepared_path=str(tmp_path / "prepared"))
    cli_train(tmp_path, first, "first.yml")
    assert len(opened) >= 6  # every row encoded once (the loader may run one batch ahead)
    streams = list((tmp_path / "prepared").glob("stream-*"))
    assert len(streams) == 1
    part = next(streams[0].glob("rows-*.jsonl"))
    part.write_text(part.read_text() + '{"position": 99, "row": {"input_')  # a writer killed mid-line

    opened.clear()
    second = mm_config(tmp_path / "second", **common, dataset_prepared_path=str(tmp_path / "prepared"))
    cli_train(tmp_path, second, "second.yml")
    assert opened == []
    assert logged_losses(second["output_dir"]) == logged_losses(first["output_dir"])

    third = mm_config(tmp_path / "third", **common, dataset_prepared_path=str(tmp_path / "prepared"), image_size=16)
    cli_train(tmp_path, third, "third.yml")
    assert opened and len(list((tmp_path / "prepared").glob("stream-*"))) == 2
