"""Images stay inside `image_base_dir` every time they are opened, remote images are stored only when whole, and
a row too long for `sequence_len` is stopped before its images are decoded or processed.

Nothing here touches the network: remote images come from a fake at `remote_images.fetch`, the one seam through
which hellbender fetches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

import hellbender.data.formats.multimodal_chat as multimodal_chat
import hellbender.data.remote_images as remote_images
from hellbender.cli import app
from hellbender.config import validate_config
from hellbender.data.contexts import image_policy
from hellbender.data.images import ImagePolicy, ImageProblem, open_image
from hellbender.data.multimodal_collator import MultimodalCollator
from hellbender.data.prepare import prepare_datasets
from hellbender.data.remote_images import FetchedBody
from hellbender.data.vision_tokens import image_token_floor
from hellbender.errors import DataError
from hellbender.models.loading import load_tokenizer_and_processor
from tests.conftest import write_config, write_jsonl
from tests.helpers import assert_user_error
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")


def row(*images: str, question: str = "What colour is it?", answer: str = "Red.") -> dict:
    parts = [{"type": "image", "path": p} for p in images] + [{"type": "text", "text": question}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def png(colour: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (32, 32)) -> bytes:
    import io

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def make_cfg(tmp: Path, rows: Path, entry: dict | None = None, base_model: str = QWEN, **top):
    return validate_config(
        {
            "base_model": base_model,
            "processor_type": "AutoProcessor",
            "datasets": [{"path": str(rows), "type": "chat_template", **(entry or {})}],
            "dataset_prepared_path": str(tmp / "prepared"),
            "output_dir": str(tmp / "out"),
            "max_image_pixels": 2000,
            "shuffle_merged_datasets": False,
            **top,
        }
    )


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("load")
    return {
        name: load_tokenizer_and_processor(make_cfg(tmp, tmp / "x.jsonl", base_model=name))
        for name in (QWEN, GEMMA4, LLAVA, IDEFICS3)
    }


@pytest.fixture
def data(tmp_path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "red.png").write_bytes(png())
    (d / "green.png").write_bytes(png((30, 200, 30)))
    (tmp_path / "secret.png").write_bytes(png((9, 9, 9)))
    return d


# ------------------------------------------------------------------------------------------------ the sandbox at batch time


def test_an_image_swapped_for_an_outgoing_symlink_after_preparation_is_refused_at_batch_time(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png")])
    cfg = make_cfg(tmp_path, rows)
    tokenizer, processor = loaded[QWEN]
    prepared = prepare_datasets(cfg, tokenizer, processor)
    assert prepared.train[0]["image_base_dir"] == str(data.resolve())
    collate = MultimodalCollator(processor, image_policy(cfg))
    collate(list(prepared.train))  # fine as prepared

    (data / "red.png").unlink()
    (data / "red.png").symlink_to(tmp_path / "secret.png")  # same size: only the sandbox can tell
    with pytest.raises(DataError) as err:
        collate([prepared.train[0]])
    message = str(err.value)
    assert f"image `{data / 'red.png'}` resolves to `{tmp_path / 'secret.png'}`" in message
    assert f"outside `image_base_dir` `{data.resolve()}`" in message
    assert "\n" not in message
    collate([prepared.train[1]])  # the untouched row still collates


def test_a_symlink_that_stays_inside_image_base_dir_is_still_fine_at_batch_time(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    cfg = make_cfg(tmp_path, rows)
    tokenizer, processor = loaded[QWEN]
    prepared = prepare_datasets(cfg, tokenizer, processor)
    (data / "red.png").rename(data / "moved.png")
    (data / "red.png").symlink_to("moved.png")
    batch = MultimodalCollator(processor, image_policy(cfg))([prepared.train[0]])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_train_refuses_an_image_swapped_after_preprocess_in_one_paragraph(tmp_path, data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png", answer="Green.")])
    config = {
        "base_model": QWEN,
        "processor_type": "AutoProcessor",
        "datasets": [{"path": str(rows), "type": "chat_template"}],
        "dataset_prepared_path": "prepared",
        "output_dir": "out",
        "max_image_pixels": 2000,
        "max_steps": 2,
        "micro_batch_size": 2,
    }
    path = write_config(tmp_path / "config.yml", json.dumps(config))
    assert CliRunner().invoke(app, ["preprocess", str(path)]).exit_code == 0
    (data / "green.png").unlink()
    (data / "green.png").symlink_to(tmp_path / "secret.png")

    result = CliRunner().invoke(app, ["train", str(path)])
    assert_user_error(result, "green.png", "secret.png", "outside `image_base_dir`", "can no longer be used")
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_a_stored_remote_image_swapped_for_a_symlink_is_not_followed(tmp_path, data, loaded, monkeypatch):
    monkeypatch.setattr(remote_images, "fetch", lambda url: FetchedBody(png((250, 250, 0)), "image/png", None))
    rows = write_jsonl(data / "rows.jsonl", [row("https://img.example/yellow.png", answer="Yellow.")])
    cfg = make_cfg(tmp_path, rows, {"allow_remote_images": True})
    tokenizer, processor = loaded[QWEN]
    prepared = prepare_datasets(cfg, tokenizer, processor)
    (stored,) = prepared.train[0]["images"]
    Path(stored).unlink()
    Path(stored).symlink_to(tmp_path / "secret.png")

    with pytest.raises(DataError, match=r"resolves to `.*secret.png`, outside `image_base_dir`"):
        MultimodalCollator(processor, image_policy(cfg))([prepared.train[0]])
    policy = image_policy(cfg, base_dir=data, allow_remote=True)
    with pytest.raises(ImageProblem, match="secret.png"):  # nor reused by a new preparation
        remote_images.download("https://img.example/yellow.png", policy)


def test_damaged_cached_pixels_are_a_data_error_not_a_crash(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    cfg = make_cfg(tmp_path, rows, cache_images=True)
    tokenizer, processor = loaded[QWEN]
    cached = dict(prepare_datasets(cfg, tokenizer, processor).train[0])
    cached["pixels"] = [{**cached["pixels"][0], "rgb": cached["pixels"][0]["rgb"][:100]}]
    with pytest.raises(DataError, match=r"a cached image \(32x32\) holds 100 bytes of pixels instead of 3072"):
        MultimodalCollator(processor, image_policy(cfg))([cached])


def test_open_image_checks_the_policy_directories_itself(tmp_path, data):
    (data / "out.png").symlink_to(tmp_path / "secret.png")
    policy = ImagePolicy(base_dir=data, allow_remote=False, max_pixels=10_000)
    assert open_image(data / "red.png", policy).size == (32, 32)
    with pytest.raises(ImageProblem, match="outside `image_base_dir`"):
        open_image(data / "out.png", policy)
    # Command-line images (`infer --image`) are named by the user and opened where they are.
    assert open_image(data / "out.png", ImagePolicy(None, False, 10_000)).size == (32, 32)


# ------------------------------------------------------------------------------------------------ remote images


def serve(monkeypatch, bodies: dict[str, FetchedBody]) -> list[str]:
    fetched: list[str] = []

    def fetch(url: str) -> FetchedBody:
        fetched.append(url)
        return bodies[url]

    monkeypatch.setattr(remote_images, "fetch", fetch)
    return fetched


def remote_policy(tmp_path: Path) -> ImagePolicy:
    return ImagePolicy(tmp_path, True, 10_000, download_dir=tmp_path / "remote_images")


def noisy_png() -> bytes:
    """A PNG whose pixel data fills most of the file, so a cut body is cut through the pixels."""
    import io
    import random

    buf = io.BytesIO()
    Image.frombytes("RGB", (32, 32), random.Random(0).randbytes(32 * 32 * 3)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (FetchedBody(b"<html>log in</html>", "text/html; charset=utf-8", 19), "returned a `text/html` page"),
        (FetchedBody(b"<html>log in</html>", "image/png", 19), "cannot be decoded"),
        (FetchedBody(noisy_png()[:300], "image/png", len(noisy_png())), "arrived cut short (300 of the"),
        (FetchedBody(noisy_png()[:-300], "image/png", None), "cannot be decoded"),
        (FetchedBody(b"", "image/png", None), "empty"),
    ],
    ids=["html", "html-as-png", "cut-short", "truncated-no-length", "empty"],
)
def test_a_bad_remote_body_is_refused_and_never_stored(tmp_path, monkeypatch, body, words):
    fetched = serve(monkeypatch, {"https://img.example/a.png": body})
    policy = remote_policy(tmp_path)
    for _ in range(2):  # refused again, fetched again: nothing was stored to reuse
        with pytest.raises(ImageProblem, match="https://img.example/a.png") as err:
            remote_images.download("https://img.example/a.png", policy)
        assert words in str(err.value)
    assert fetched == ["https://img.example/a.png"] * 2
    assert not (tmp_path / "remote_images").exists() or not list((tmp_path / "remote_images").iterdir())


def test_a_whole_remote_image_is_stored_once_under_its_name_without_temporary_files(tmp_path, monkeypatch):
    fetched = serve(monkeypatch, {"https://img.example/a.png": FetchedBody(png(), "image/png", len(png()))})
    policy = remote_policy(tmp_path)
    first = remote_images.download("https://img.example/a.png", policy)
    again = remote_images.download("https://img.example/a.png", policy)
    assert first == again and first.read_bytes() == png()
    assert fetched == ["https://img.example/a.png"]
    assert [p.name for p in (tmp_path / "remote_images").iterdir()] == [first.name]  # no `.partial` left


def test_a_bad_body_stored_by_an_older_version_is_fetched_anew(tmp_path, monkeypatch):
    fetched = serve(monkeypatch, {"https://img.example/a.png": FetchedBody(png(), "image/png", None)})
    policy = remote_policy(tmp_path)
    first = remote_images.download("https://img.example/a.png", policy)
    first.write_bytes(b"<html>log in</html>")
    again = remote_images.download("https://img.example/a.png", policy)
    assert again == first and again.read_bytes() == png()
    assert len(fetched) == 2


def test_a_failed_store_leaves_no_partial_file(tmp_path, monkeypatch):
    serve(monkeypatch, {"https://img.example/a.png": FetchedBody(png(), "image/png", None)})

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(remote_images.os, "replace", failing_replace)
    with pytest.raises(ImageProblem, match="could not be stored as .*No space left on device"):
        remote_images.download("https://img.example/a.png", remote_policy(tmp_path))
    assert list((tmp_path / "remote_images").iterdir()) == []


# ------------------------------------------------------------------------------------------------ long rows


@pytest.mark.parametrize("name", [QWEN, GEMMA4, LLAVA, IDEFICS3], ids=lambda n: n.split("/")[-1])
def test_the_image_token_floor_never_exceeds_the_real_expansion(loaded, name):
    processor = loaded[name][1]
    for size in ((32, 32), (40, 24), (16, 48)):
        expanded = processor(text=[processor.image_token], images=[[Image.new("RGB", size)]], add_special_tokens=False)[
            "input_ids"
        ][0]
        assert 1 <= image_token_floor(processor, [size]) <= len(expanded), size


def test_a_long_image_row_is_dropped_without_decoding_its_images_or_calling_the_processor(
    tmp_path, data, loaded, monkeypatch
):
    long_question = "Which colour is this square? " * 300
    rows = write_jsonl(data / "rows.jsonl", [row("red.png", question=long_question), row("green.png")])
    cfg = make_cfg(tmp_path, rows, sequence_len=128)
    tokenizer, processor = loaded[QWEN]
    opened, expanded = [], []
    real_open, real_expand = multimodal_chat.open_image, multimodal_chat.expand
    monkeypatch.setattr(
        multimodal_chat, "open_image", lambda path, policy: opened.append(path.name) or real_open(path, policy)
    )
    monkeypatch.setattr(
        multimodal_chat, "expand", lambda proc, text, images: expanded.append(text) or real_expand(proc, text, images)
    )

    prepared = prepare_datasets(cfg, tokenizer, processor)
    assert prepared.stats["train"]["rows_dropped"] == {"longer than sequence_len": 1}
    assert opened == ["green.png"]  # the long row's image was never decoded
    assert len(expanded) == 1 and long_question not in expanded[0]
