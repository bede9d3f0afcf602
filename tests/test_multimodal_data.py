"""Vision-language data from file to batch: bad rows fail naming the row and the file, images stay inside
`image_base_dir`, remote images are fetched only when allowed, the prepared cache follows the processor, and the
batch-time collator reproduces the prepared labels."""

from __future__ import annotations

import copy
import functools
import http.server
import json
import random
import shutil
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import hellbender.data.prepare as prepare_mod
from hellbender.cli import app
from hellbender.config import validate_config
from hellbender.data.contexts import image_policy
from hellbender.data.multimodal_collator import MultimodalCollator
from hellbender.data.prepare import prepare_datasets
from hellbender.errors import ConfigError, DataError
from hellbender.models.loading import load_tokenizer_and_processor
from hellbender.models.tiny import tiny_model_dir
from tests.conftest import write_config, write_jsonl
from tests.helpers import assert_user_error
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

FAMILIES = [QWEN, GEMMA4, LLAVA, IDEFICS3]
SMALL_PIXELS = 2000  # `max_image_pixels` for these tests: 32x32 (1024) passes, 64x64 (4096) does not


def row(*images: str, question: str = "What colour is it?", answer: str = "Red.") -> dict:
    parts = [{"type": "image", "path": p} for p in images] + [{"type": "text", "text": question}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """name -> (tokenizer, processor), loaded once through hellbender's loading path (read-only in tests)."""
    tmp = tmp_path_factory.mktemp("load")
    return {name: load_tokenizer_and_processor(make_cfg(tmp, tmp / "x.jsonl", base_model=name)) for name in FAMILIES}


@pytest.fixture
def data(tmp_path) -> Path:
    """A data directory with good 32x32 images, one too large, one corrupt, and an image just outside it."""
    d = tmp_path / "data"
    d.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(d / "red.png")
    Image.new("RGB", (32, 32), (30, 200, 30)).save(d / "green.png")
    Image.new("RGB", (64, 64), (30, 30, 200)).save(d / "big.png")
    (d / "corrupt.png").write_bytes(random.Random(0).randbytes(400))
    Image.new("RGB", (32, 32), (9, 9, 9)).save(tmp_path / "outside.png")
    (d / "link.png").symlink_to(tmp_path / "outside.png")
    return d


def make_cfg(tmp: Path, path: Path, entry: dict | None = None, **top):
    raw = {
        "base_model": QWEN,
        "processor_type": "AutoProcessor",
        "datasets": [{"path": str(path), "type": "chat_template", **(entry or {})}],
        "dataset_prepared_path": str(tmp / "prepared"),
        "output_dir": str(tmp / "out"),
        "max_image_pixels": SMALL_PIXELS,
        **top,
    }
    return validate_config(raw)


def prepare(loaded, cfg, processor=None):
    tokenizer, default_processor = loaded[cfg.base_model]
    return prepare_datasets(cfg, tokenizer, processor or default_processor)


# ------------------------------------------------------------------------------------------------ bad rows, CLI


def invoke_preprocess(tmp_path: Path, config: dict):
    path = write_config(tmp_path / "config.yml", json.dumps(config))  # JSON is YAML
    return CliRunner().invoke(app, ["preprocess", str(path)])


BAD_IMAGES = {
    # name: (image reference in row 1, words the message must hold)
    "dotdot": ("../outside.png", ["outside `image_base_dir`"]),
    "absolute_outside": ("{tmp}/outside.png", ["outside `image_base_dir`"]),
    "symlink_out": ("link.png", ["outside `image_base_dir`", "outside.png"]),
    "remote_not_allowed": ("http://127.0.0.1:9/red.png", ["remote", "allow_remote_images: true"]),
    "missing": ("nope.png", ["nope.png", "does not exist"]),
    "corrupt": ("corrupt.png", ["corrupt.png", "corrupt"]),
    "too_large": ("big.png", ["big.png", "64x64", f"max_image_pixels: {SMALL_PIXELS}"]),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_image_fails_preprocess_naming_the_row_and_the_file(tmp_path, data, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    ref, needles = BAD_IMAGES[case]
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row(ref.format(tmp=tmp_path))])
    config = {
        "base_model": QWEN,
        "processor_type": "AutoProcessor",
        "max_image_pixels": SMALL_PIXELS,
        "datasets": [{"path": str(rows), "type": "chat_template"}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"),
    }
    result = invoke_preprocess(tmp_path, config)
    assert_user_error(result, "row 1", str(rows), "skip_bad_images", *needles)
    assert not list((tmp_path / "prepared").glob("*/hellbender_prepared.json"))  # nothing half-prepared


@pytest.mark.parametrize(
    "processor_type, base_model, needles",
    [
        ("NoSuchProcessor", QWEN, ["processor_type: NoSuchProcessor", "not a transformers processor class"]),
        ("AutoProcessor", "hellbender/tiny-llama", ["no image processor", "processor_type", "text model"]),
    ],
    ids=["unknown_class", "text_only_model"],
)
def test_bad_processor_type_fails_preprocess_clearly(tmp_path, data, monkeypatch, processor_type, base_model, needles):
    monkeypatch.chdir(tmp_path)
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    config = {
        "base_model": base_model,
        "processor_type": processor_type,
        "datasets": [{"path": str(rows), "type": "chat_template"}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"),
    }
    assert_user_error(invoke_preprocess(tmp_path, config), *needles)
    # The same through the library call the CLI makes.
    with pytest.raises(ConfigError):
        load_tokenizer_and_processor(validate_config(config))


# ------------------------------------------------------------------------------------------------ placeholders


IGNORES_IMAGES = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}"
)


def test_template_that_renders_no_placeholder_for_an_image_is_refused(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png")])
    cfg = make_cfg(tmp_path, rows, {"chat_template": "jinja", "chat_template_jinja": IGNORES_IMAGES})
    tokenizer, processor = loaded[QWEN]
    with pytest.raises(DataError) as err:
        prepare_datasets(cfg, tokenizer, processor)
    message = str(err.value)
    assert "row 0" in message and str(rows) in message
    assert "0 image placeholder(s) but the row has 1 image(s)" in message


def test_image_token_written_in_the_text_is_counted_against_the_images(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png", question="See <|image_pad|> here")])
    with pytest.raises(DataError) as err:
        prepare(loaded, make_cfg(tmp_path, rows))
    message = str(err.value)
    assert "row 1" in message and str(rows) in message
    assert "2 image placeholder(s) but the row has 1 image(s)" in message


# ------------------------------------------------------------------------------------------------ skip_bad_images


def test_skip_bad_images_drops_and_counts_the_bad_rows_and_keeps_the_good(tmp_path, data, loaded):
    bad = [ref.format(tmp=tmp_path) for ref, _ in BAD_IMAGES.values()]
    good = [row("red.png", answer="Red."), row("green.png", "red.png", answer="Green and red.")]
    rows = write_jsonl(data / "rows.jsonl", [good[0], *(row(b) for b in bad), good[1]])
    prepared = prepare(loaded, make_cfg(tmp_path, rows, {"skip_bad_images": True}))

    stats = prepared.stats["train"]
    assert stats["rows_in"] == 2 + len(bad)
    assert stats["rows_kept"] == 2
    assert stats["rows_dropped"] == {
        "image outside image_base_dir": 3,
        "remote image not allowed": 1,
        "image missing": 1,
        "image corrupt": 1,
        "image too large": 1,
    }
    kept = sorted(prepared.train["images"])
    assert kept == sorted([[str(data / "red.png")], [str(data / "green.png"), str(data / "red.png")]])
    tokenizer = loaded[QWEN][0]
    answers = {tokenizer.decode([x for x in r["labels"] if x != -100]) for r in prepared.train}
    assert answers == {"Red.<|im_end|>", "Green and red.<|im_end|>"}


# ------------------------------------------------------------------------------------------------ remote images


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def do_GET(self):
        self.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def image_server(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 (port chosen by the OS) serving a directory; yields (url, dir, requests)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    served = tmp_path / "served"
    served.mkdir()
    requests: list[str] = []
    handler = type("Handler", (_CountingHandler,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served, requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_allowed_remote_image_is_fetched_once_stored_and_trains(tmp_path, data, loaded, image_server):
    base, served, requests = image_server
    Image.new("RGB", (32, 32), (250, 250, 0)).save(served / "yellow.png")
    rows = write_jsonl(data / "rows.jsonl", [row(f"{base}/yellow.png", answer="Yellow.")])
    cfg = make_cfg(tmp_path, rows, {"allow_remote_images": True})
    prepared = prepare(loaded, cfg)

    assert requests == ["/yellow.png"]
    (stored,) = prepared.train[0]["images"]
    assert Path(stored).parent == tmp_path / "prepared" / "remote_images"
    assert Path(stored).read_bytes() == (served / "yellow.png").read_bytes()
    tokenizer, processor = loaded[QWEN]
    assert tokenizer.decode([x for x in prepared.train[0]["labels"] if x != -100]) == "Yellow.<|im_end|>"
    assert prepared.train[0]["input_ids"].count(processor.image_token_id) == 4  # 32x32: 4 soft tokens
    batch = MultimodalCollator(processor, image_policy(cfg))([prepared.train[0]])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]

    # A new preparation (another cache key) uses the stored copy instead of fetching again.
    again = prepare(loaded, make_cfg(tmp_path, rows, {"allow_remote_images": True}, sequence_len=1024))
    assert not again.from_cache and again.cache_dir != prepared.cache_dir
    assert requests == ["/yellow.png"]


def test_remote_image_that_cannot_be_fetched_names_the_row(tmp_path, data, loaded, image_server):
    base, _, _ = image_server
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row(f"{base}/gone.png")])
    with pytest.raises(DataError) as err:
        prepare(loaded, make_cfg(tmp_path, rows, {"allow_remote_images": True}))
    message = str(err.value)
    assert "row 1" in message and str(rows) in message and f"{base}/gone.png" in message
    assert "could not be fetched" in message


# ------------------------------------------------------------------------------------------------ the cache


@pytest.fixture
def count_tokenize(monkeypatch):
    calls = []
    real = prepare_mod.tokenize_dataset

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_mod, "tokenize_dataset", counting)
    return calls


def test_second_prepare_reuses_the_cache_without_tokenizing(tmp_path, data, loaded, count_tokenize):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png", "red.png")])
    first = prepare(loaded, make_cfg(tmp_path, rows))
    second = prepare(loaded, make_cfg(tmp_path, rows))

    assert count_tokenize == ["multimodal_chat"]
    assert not first.from_cache and second.from_cache
    assert second.cache_dir == first.cache_dir
    assert list(second.train) == list(first.train)


def test_changed_image_processor_setting_gets_its_own_cache(tmp_path, data, loaded, count_tokenize):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    cfg = make_cfg(tmp_path, rows)
    first = prepare(loaded, cfg)
    bigger = copy.deepcopy(loaded[QWEN][1])
    bigger.image_processor.size = {"shortest_edge": 64, "longest_edge": 32 * 32}  # max_pixels 256 -> 1024
    second = prepare(loaded, cfg, processor=bigger)

    assert len(count_tokenize) == 2 and not second.from_cache
    assert second.cache_dir != first.cache_dir
    image_id = bigger.image_token_id
    # 32x32 is no longer shrunk to 16x16: 8x8 patches merged 2x2 = 16 soft tokens instead of 4.
    assert (first.train[0]["input_ids"].count(image_id), second.train[0]["input_ids"].count(image_id)) == (4, 16)


def test_changed_processor_chat_template_gets_its_own_cache(tmp_path, data, loaded, count_tokenize):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    cfg = make_cfg(tmp_path, rows)
    first = prepare(loaded, cfg)
    other = copy.deepcopy(loaded[QWEN][1])
    other.chat_template = "<|im_start|>system\nBe brief.<|im_end|>\n" + other.chat_template
    second = prepare(loaded, cfg, processor=other)

    assert not second.from_cache and second.cache_dir != first.cache_dir


def test_tokenizer_default_uses_the_processors_template_when_the_tokenizer_has_none(tmp_path, data):
    """Older hub VLM checkpoints (llava-hf, ...) keep their chat template only in the processor's
    chat_template.json; `chat_template: tokenizer_default` means the model's own template, which is that one."""
    model = tmp_path / "llava-processor-template"
    shutil.copytree(tiny_model_dir("hellbender/tiny-llava"), model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    cfg = make_cfg(tmp_path, rows, base_model=str(model))
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    assert processor.chat_template == template  # the model does have its template

    prepared = prepare_datasets(cfg, tokenizer, processor)
    assert prepared.train[0]["text"] == "USER: <image>\nWhat colour is it? ASSISTANT: Red.<|endoftext|>"


@pytest.mark.parametrize("image_size", [8, 16])
def test_image_size_is_part_of_the_cache_key(tmp_path, data, loaded, count_tokenize, image_size):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    plain = prepare(loaded, make_cfg(tmp_path, rows))
    resized = prepare(loaded, make_cfg(tmp_path, rows, image_size=image_size))

    assert len(count_tokenize) == 2 and resized.cache_dir != plain.cache_dir
    image_id = loaded[QWEN][1].image_token_id
    # 32x32 -> 16x16 by the processor either way (4 soft tokens); resized to 8x8 first, it is 1.
    assert resized.train[0]["input_ids"].count(image_id) == {8: 1, 16: 4}[image_size]
    assert plain.train[0]["input_ids"].count(image_id) == 4


# ------------------------------------------------------------------------------------------------ the collator


@pytest.mark.parametrize("name", FAMILIES, ids=lambda n: n.split("/")[-1])
def test_collator_reproduces_prepared_labels_for_image_and_text_only_rows(tmp_path, data, loaded, name):
    rows = write_jsonl(
        data / "rows.jsonl",
        [row("red.png"), row(question="No picture here, just text?", answer="Fine."), row("green.png", "red.png")],
    )
    cfg = make_cfg(tmp_path, rows, base_model=name, shuffle_merged_datasets=False)
    prepared = prepare(loaded, cfg)
    tokenizer, processor = loaded[name]
    prepared_rows = list(prepared.train)
    assert [len(r["images"]) for r in prepared_rows] == [1, 0, 2]

    collate = MultimodalCollator(processor, image_policy(cfg))
    for batch_rows in (prepared_rows, prepared_rows[1:2], prepared_rows[:2]):
        batch = collate(batch_rows)
        width = batch["input_ids"].shape[1]
        for i, r in enumerate(batch_rows):
            n = len(r["input_ids"])
            assert batch["input_ids"][i, :n].tolist() == r["input_ids"]
            assert batch["labels"][i].tolist() == r["labels"] + [-100] * (width - n)
            assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
            assert set(batch["input_ids"][i, n:].tolist()) <= {tokenizer.pad_token_id}
        assert tokenizer.pad_token_id not in batch["labels"][batch["attention_mask"].bool()].tolist()
        has_images = any(r["images"] for r in batch_rows)
        assert ("pixel_values" in batch) == has_images
        if name == QWEN and has_images:
            images = sum(len(r["images"]) for r in batch_rows)
            assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * images
            assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == processor.image_token_id)


def test_collator_pads_on_the_right_whatever_the_processor_pads_by_default(tmp_path, data, loaded):
    """Aya Vision's processor (and others) pads on the left unless a call says otherwise; the prepared ids and labels
    start at the left of each row, so the collator asks for right padding in every call."""
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row(question="Only text, and longer than the other?")])
    cfg = make_cfg(tmp_path, rows, shuffle_merged_datasets=False)
    prepared = list(prepare(loaded, cfg).train)
    processor = copy.deepcopy(loaded[QWEN][1])
    processor.tokenizer.padding_side = "left"  # what such a processor's defaults do to every call
    batch = MultimodalCollator(processor, image_policy(cfg))(prepared)
    lengths = [len(r["input_ids"]) for r in prepared]
    assert lengths[0] != lengths[1]
    for i, r in enumerate(prepared):
        assert batch["input_ids"][i, : lengths[i]].tolist() == r["input_ids"]
        assert batch["attention_mask"][i].tolist() == [1] * lengths[i] + [0] * (max(lengths) - lengths[i])


def test_collator_refuses_an_image_replaced_by_one_of_another_size(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png")])
    cfg = make_cfg(tmp_path, rows, shuffle_merged_datasets=False, max_image_pixels=1_000_000)
    prepared = prepare(loaded, cfg)
    collate = MultimodalCollator(loaded[QWEN][1], image_policy(cfg))
    collate(list(prepared.train))  # fine as prepared

    Image.new("RGB", (64, 32), (200, 30, 30)).save(data / "red.png")  # 2 soft tokens instead of 4
    with pytest.raises(DataError, match="red.png"):
        collate(list(prepared.train))
    collate([prepared.train[1]])  # the untouched row still collates


def test_collator_reports_an_image_deleted_after_preparation_as_a_data_error(tmp_path, data, loaded):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png")])
    cfg = make_cfg(tmp_path, rows)
    prepared = prepare(loaded, cfg)
    (data / "red.png").unlink()
    collate = MultimodalCollator(loaded[QWEN][1], image_policy(cfg))
    with pytest.raises(DataError, match="red.png"):
        collate(list(prepared.train))


# ------------------------------------------------------------------------------------------------ cache_images


def test_cache_images_stores_the_pixels_so_training_opens_no_image_file(tmp_path, data):
    rows = write_jsonl(data / "rows.jsonl", [row("red.png"), row("green.png", "red.png", answer="Green, red.")])
    loaded_qwen = load_tokenizer_and_processor(make_cfg(tmp_path, rows))
    tokenizer, processor = loaded_qwen
    plain_cfg = make_cfg(tmp_path, rows)
    cached_cfg = make_cfg(tmp_path, rows, cache_images=True)
    plain = prepare_datasets(plain_cfg, tokenizer, processor)
    cached = prepare_datasets(cached_cfg, tokenizer, processor)
    assert cached.cache_dir != plain.cache_dir
    assert [len(p) for p in cached.train["pixels"]] == [len(p) for p in cached.train["images"]] and plain.train[0][
        "pixels"
    ] == []

    expected = MultimodalCollator(processor, image_policy(plain_cfg))([plain.train[i] for i in range(2)])
    for name in ("red.png", "green.png"):
        (data / name).unlink()  # training must not need the files any more
    got = MultimodalCollator(processor, image_policy(cached_cfg))([cached.train[i] for i in range(2)])
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_text_only_rows_before_image_rows_keep_the_image_columns_typed(tmp_path, data):
    """The first tokenized rows (a whole writer batch) have no images; their empty `images` lists must not fix
    the column's type before the image rows arrive."""
    text_only = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        ]
    }
    rows = write_jsonl(data / "rows.jsonl", [text_only] * 1001 + [row("red.png")])
    prepared = prepare_datasets(
        make_cfg(tmp_path, rows, shuffle_merged_datasets=False), *load_tokenizer_and_processor(make_cfg(tmp_path, rows))
    )
    assert prepared.train.features["images"].feature.dtype == "string"
    assert prepared.train[1001]["images"] == [str(data / "red.png")]
