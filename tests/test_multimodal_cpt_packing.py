"""Sample packing of prepared multimodal continued-pretraining rows (`type: multimodal_pretrain`) on the tiny
Qwen2.5-VL, Qwen3-VL, Gemma 4, LLaVA and Idefics3: a packed row of image+text documents gives every token the loss it has when
its document runs alone, nothing flows from one document into another, and a row that cannot fit a bin is dropped
and counted or refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hellbender.config import validate_config
from tests.conftest import write_jsonl
from tests.helpers import vlm_config
from tests.test_multimodal_packing import PACKABLE, forward, lora_model
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN, QWEN3

IMAGE_TEXT = {
    QWEN: "<|vision_start|><|image_pad|><|vision_end|>",
    QWEN3: "<|vision_start|><|image_pad|><|vision_end|>",
    GEMMA4: "<image_soft_token>",
    LLAVA: "<image>",
    IDEFICS3: "<image>",
}
# Max |per-token loss difference| packed vs alone, fp32 CPU.
LOSS_TOLERANCE = 1e-5


def cpt_rows(tmp_path, name: str, many_images: bool = False):
    """Three documents with one, two and one images of different sizes (different Qwen grids), images inside and
    around the text."""
    from PIL import Image

    sizes = {"a.png": (32, 32), "b.png": (56, 28), "c.png": (28, 42), "d.png": (40, 40)}
    for seed, (image, size) in enumerate(sizes.items()):
        Image.new("RGB", size, (40 * seed + 30, 200 - 40 * seed, 90)).save(tmp_path / image)
    img = IMAGE_TEXT[name]
    rows = [
        {"text": f"{img}A warm red square on white.", "images": ["a.png"]},
        {"text": f"Two pictures: {img} the wide one, then {img} the tall one.", "images": ["b.png", "c.png"]},
        {"text": f"A square {img}", "images": ["d.png"]},
    ]
    if many_images:  # images whose tokens alone fill more than a bin of 256, and a short caption
        rows.append({"text": img * 80 + "Many squares.", "images": ["a.png"] * 80})
    return write_jsonl(tmp_path / f"cpt-{many_images}.jsonl", rows)


def prepared(tmp_path, name: str, packing: bool, sequence_len: int = 1024, many_images: bool = False, **keys):
    from hellbender.data.batching import build_collator
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer_and_processor

    data = cpt_rows(tmp_path, name, many_images)
    cfg = validate_config(
        vlm_config(
            tmp_path,
            name,
            datasets=[{"path": str(data), "type": "multimodal_pretrain", "image_base_dir": str(tmp_path)}],
            sequence_len=sequence_len,
            sample_packing=packing,
            dataset_prepared_path=str(tmp_path / f"prepared-{packing}-{many_images}-{keys}"),
            **keys,
        )
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    result = prepare_datasets(cfg, tokenizer, processor)
    return result, build_collator(cfg, tokenizer, processor)


def pretokenized(tmp_path, name: str, sequence_len: int = 1024, many_images: bool = False, **keys):
    """The same documents as already-tokenized rows (`skip_prepare_dataset: true`): (packed rows, the rows, the
    collator)."""
    import json

    from hellbender.data.batching import build_collator
    from hellbender.data.pretokenized_multimodal import pretokenized_multimodal_rows
    from hellbender.data.pretokenized_packing import packed_pretokenized_rows
    from hellbender.models.loading import load_tokenizer_and_processor

    source = cpt_rows(tmp_path, name, many_images)
    raw = [json.loads(line) for line in source.read_text().splitlines()]
    cfg = validate_config(
        vlm_config(
            tmp_path,
            name,
            datasets=[{"path": str(source), "type": "multimodal_pretrain", "image_base_dir": str(tmp_path)}],
            sequence_len=sequence_len,
            sample_packing=True,
            skip_prepare_dataset=True,
            dataset_prepared_path=str(tmp_path / "pretokenized"),
            **keys,
        )
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    image_ids = set(tokenizer(IMAGE_TEXT[name], add_special_tokens=False)["input_ids"])
    rows = []
    for row in raw:
        text = row["text"] + tokenizer.eos_token
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        labels = [-100 if i in image_ids else i for i in ids]  # image markers are not trained, as when prepared
        rows.append({"_mm_text": text, "images": row["images"], "input_ids": ids, "labels": labels})
    data = write_jsonl(tmp_path / f"pretokenized-{many_images}.jsonl", rows)
    cfg.datasets[0].path = str(data)
    documents = pretokenized_multimodal_rows(cfg)
    return (
        packed_pretokenized_rows(cfg, documents, tokenizer, processor),
        documents,
        build_collator(cfg, tokenizer, processor),
    )


def packed_and_alone(tmp_path, name: str, source: str):
    """(the one packed row of the three documents, the documents as unpacked rows, the collator)."""
    if source == "pretokenized":
        packed, documents, collator = pretokenized(tmp_path, name)
        assert len(packed) == 1
        return packed[0], [documents[i] for i in range(len(documents))], collator
    packed, collator = prepared(tmp_path, name, packing=True)
    alone, _ = prepared(tmp_path, name, packing=False)
    assert packed.stats["packed_bins"] == 1
    return packed.train[0], list(alone.train), collator


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of predicting each token from the ones before it (0 where the label is masked)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="none"
    ).view(labels.shape[0], -1)


SOURCES = ["prepared", "pretokenized"]


@pytest.mark.parametrize("source", SOURCES)
@PACKABLE
def test_packed_cpt_documents_each_get_the_per_token_loss_they_have_alone(tmp_path, name, bidirectional, source):
    from hellbender.data.collator import REAL_TOKENS_KEY

    row, alone, collator = packed_and_alone(tmp_path, name, source)
    singles = [collator.documents([doc]) for doc in alone]
    # Bins are filled by each document's full length, its image tokens included, measured before training.
    assert row["seq_lens"] == sorted((int(one[REAL_TOKENS_KEY][0]) for one in singles), reverse=True)
    model = lora_model(name, bidirectional_images=bidirectional)

    batch = collator([row])
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed_losses = token_losses(forward(model, batch), batch["labels"])[0]
    by_text = {doc["text"]: i for i, doc in enumerate(row["documents"])}
    starts = [sum(row["seq_lens"][:i]) for i in range(len(row["seq_lens"]))]
    worst, trained = 0.0, 0
    for doc, one in zip(alone, singles, strict=True):
        i = by_text[doc["text"]]
        n = row["seq_lens"][i]
        assert torch.equal(batch["input_ids"][0, starts[i] : starts[i] + n], one["input_ids"][0])
        with torch.no_grad():
            losses = token_losses(forward(model, one), one["labels"])[0]
        assert torch.equal(batch["labels"][0, starts[i] + 1 : starts[i] + n], one["labels"][0, 1:])
        trained += int((one["labels"][0, 1:] != -100).sum())
        worst = max(worst, (packed_losses[starts[i] : starts[i] + n - 1] - losses).abs().max().item())
    assert trained > 20  # the text of every document is trained
    assert worst < LOSS_TOLERANCE, worst

    if name in (QWEN, QWEN3):  # the comparison can fail: without each document's own 3-D positions the losses move
        with torch.no_grad():
            wrong = token_losses(forward(model, batch, packed_positions=False), batch["labels"])[0]
        assert (wrong - packed_losses).abs().max().item() > 1e-2


def image_rows(batch: dict, name: str, row: dict, collator) -> list[slice | tuple[int, slice]]:
    """The rows of `pixel_values` that belong to each image, in order."""
    if name == IDEFICS3:  # [document, tile]: each image's tiles in a row per document, padded with blank tiles
        from hellbender.data.multimodal_collator import prepared_images

        documents = collator.documents
        rows: list[tuple[int, slice]] = []
        for d, doc in enumerate(row["documents"]):
            start = 0
            for image in prepared_images(doc, documents.policy):
                tiles = documents.processor.image_processor(images=[[image]], return_tensors="pt")["pixel_values"]
                rows.append((d, slice(start, start + tiles.shape[1])))
                start += tiles.shape[1]
            assert batch["pixel_values"][d, start:].abs().sum() == 0  # the padding tiles the model drops
        return rows
    if name in (QWEN, QWEN3):  # patches of all images, concatenated: grid t*h*w patches each
        sizes = batch["image_grid_thw"].prod(-1).tolist()
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [slice(s, s + n) for s, n in zip(starts, sizes, strict=True)]
    return [slice(k, k + 1) for k in range(batch["pixel_values"].shape[0])]


@pytest.mark.parametrize("source", SOURCES)
@PACKABLE
def test_no_gradient_crosses_packed_cpt_documents(tmp_path, name, bidirectional, source):
    """Doc i's loss has an exactly zero gradient with respect to every other document's pixel values and input
    embeddings (and a non-zero one with respect to its own)."""
    from hellbender.data.collator import REAL_TOKENS_KEY
    from hellbender.models.packed_vision import packed_vision_inputs

    row, _, collator = packed_and_alone(tmp_path, name, source)
    batch = collator([row])
    model = lora_model(name, bidirectional_images=bidirectional)
    images_per_doc = [len(doc["images"]) for doc in row["documents"]]
    per_image = image_rows(batch, name, row, collator)
    assert len(per_image) == sum(images_per_doc) == 4
    first_image = [sum(images_per_doc[:i]) for i in range(len(images_per_doc))]
    starts = [sum(row["seq_lens"][:i]) for i in range(len(row["seq_lens"]))]

    embedded: list[torch.Tensor] = []

    def keep_grad(_module, _inputs, output):  # the embeddings as a leaf of their own, to read their gradient
        leaf = output.detach().requires_grad_(True)
        embedded.append(leaf)
        return leaf

    hook = model.get_input_embeddings().register_forward_hook(keep_grad)
    try:
        for i, n in enumerate(row["seq_lens"]):
            embedded.clear()
            model.zero_grad()
            inputs = {k: v for k, v in batch.items() if k not in (REAL_TOKENS_KEY, "labels")}
            inputs["pixel_values"] = batch["pixel_values"].clone().requires_grad_(True)
            inputs.update(packed_vision_inputs(model, inputs))
            logits = model(**inputs, use_cache=False).logits
            losses = token_losses(logits, batch["labels"])[0]
            losses[starts[i] : starts[i] + n - 1].sum().backward()
            pixel_grad = inputs["pixel_values"].grad
            token_grad = embedded[0].grad[0].abs().sum(-1)
            for j, m in enumerate(row["seq_lens"]):
                own = range(first_image[j], first_image[j] + images_per_doc[j])
                image_grads = [pixel_grad[per_image[k]].abs().sum().item() for k in own]
                tokens = token_grad[starts[j] : starts[j] + m]
                if j == i:
                    assert all(g > 0 for g in image_grads) and tokens.sum() > 0, (i, image_grads)
                else:
                    assert image_grads == [0.0] * len(own), (i, j, image_grads)
                    assert torch.count_nonzero(tokens) == 0, (i, j)
    finally:
        hook.remove()

    if source != "prepared":  # shown once per family: the check below is the same for both sources
        return
    # The check can fail: as one causal row (no document boundaries) the last document reaches the first's pixels.
    inputs = {k: v for k, v in batch.items() if k not in (REAL_TOKENS_KEY, "labels", "position_ids")}
    inputs["attention_mask"] = torch.ones_like(batch["input_ids"])
    inputs["pixel_values"] = batch["pixel_values"].clone().requires_grad_(True)
    losses = token_losses(model(**inputs, use_cache=False).logits, batch["labels"])[0]
    losses[starts[-1] : starts[-1] + row["seq_lens"][-1] - 1].sum().backward()
    assert inputs["pixel_values"].grad[per_image[0]].abs().sum() > 0


def test_a_cpt_row_too_long_for_any_bin_is_dropped_and_counted_or_refused_by_name(tmp_path):
    from hellbender.errors import DataError

    packed, _ = prepared(tmp_path, QWEN, packing=True, sequence_len=256, many_images=True)
    assert packed.stats["train"]["rows_dropped"] == {"longer than sequence_len": 1}
    documents = [doc for r in packed.train for doc in r["documents"]]
    assert sorted(len(doc["images"]) for doc in documents) == [1, 1, 2]  # the three others, packed

    message = r"row 3: at least \d+ tokens with its images expanded, more than `sequence_len: 256`"
    with pytest.raises(DataError, match=message):
        prepared(tmp_path, QWEN, packing=True, sequence_len=256, many_images=True, excess_length_strategy="raise")


def test_a_pretokenized_row_too_long_for_any_bin_is_dropped_and_counted_or_refused_by_name(tmp_path):
    from hellbender.errors import DataError

    packed, _, _ = pretokenized(tmp_path, QWEN, sequence_len=256, many_images=True)
    assert packed.dropped == 1
    assert sorted(len(doc["images"]) for b in range(len(packed)) for doc in packed[b]["documents"]) == [1, 1, 2]

    message = r"Pre-tokenized row 3 has \d+ tokens with its images expanded, more than `sequence_len: 256`"
    with pytest.raises(DataError, match=message):
        pretokenized(tmp_path, QWEN, sequence_len=256, many_images=True, excess_length_strategy="raise")


def one_epoch_in_two_bins(root: Path, **data) -> dict:
    """A packed LoRA run of one epoch, one bin per step, on tiny Qwen2.5-VL's three CPT documents (`data`: where
    they come from)."""
    return vlm_config(
        root,
        QWEN,
        sample_packing=True,
        sequence_len=64,  # the three documents (39, 25 and 13 tokens) fill two bins
        micro_batch_size=1,
        num_epochs=1,
        max_steps=None,
        adapter="lora",
        lora_target_linear=True,
        **data,
    )


def test_packed_cpt_run_from_an_unstreamed_pretraining_dataset_trains_every_document_once(tmp_path):
    """`pretraining_dataset` with `streaming: false` and `sample_packing: true`: one epoch is one step per packed bin
    (micro-batch 1), and the tokens trained are exactly those of the prepared documents."""
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer_and_processor
    from tests.helpers import cli_train, logged_losses, trainer_state

    data = cpt_rows(tmp_path, QWEN)
    entry = {"path": str(data), "type": "multimodal_pretrain", "image_base_dir": str(tmp_path)}
    cfg = one_epoch_in_two_bins(tmp_path, datasets=[], pretraining_dataset=[entry], streaming=False)
    cli_train(tmp_path, cfg)
    resolved = validate_config(cfg)
    prepared = prepare_datasets(resolved, *load_tokenizer_and_processor(resolved))
    assert prepared.from_cache and prepared.stats["packed_bins"] == 2
    assert sorted(n for row in prepared.train for n in row["seq_lens"]) == [13, 25, 39]
    state = trainer_state(cfg["output_dir"])
    assert state["global_step"] == 2 and sorted(logged_losses(cfg["output_dir"])) == [1, 2]
    counters = state["stateful_callbacks"]["TokenCounter"]["attributes"]
    assert counters["input_tokens"] == prepared.stats["train"]["tokens"] == 77


@pytest.mark.parametrize("strategy", ["drop", "raise"])
def test_a_streamed_cpt_row_too_long_is_dropped_or_refused_by_name(tmp_path, strategy):
    """Streamed documents follow `excess_length_strategy` as prepared ones do: the over-long one is skipped, or the
    stream stops naming it."""
    from itertools import islice

    from hellbender.data.streaming import StreamingMultimodalDataset
    from hellbender.errors import DataError
    from hellbender.models.loading import load_tokenizer_and_processor

    data = cpt_rows(tmp_path, QWEN, many_images=True)
    entry = {"path": str(data), "type": "multimodal_pretrain", "image_base_dir": str(tmp_path)}
    cfg = validate_config(
        vlm_config(
            tmp_path,
            QWEN,
            datasets=[],
            pretraining_dataset=[entry],
            shuffle_merged_datasets=False,
            excess_length_strategy=strategy,
        )
    )
    stream = StreamingMultimodalDataset(cfg, *load_tokenizer_and_processor(cfg))
    if strategy == "raise":
        with pytest.raises(DataError, match=r"row 3: at least \d+ tokens with its images expanded, more than"):
            list(islice(stream, 4))
    else:
        first_pass = [len(sample["images"]) for sample in islice(stream, 4)]
        assert first_pass == [1, 2, 1, 1]  # rows 0-2, then row 0 of the next pass: row 3 is skipped


def test_packed_pretokenized_run_trains_every_document_once_and_caches_the_lengths(tmp_path, monkeypatch):
    """`skip_prepare_dataset: true` with `sample_packing: true`: the full lengths are measured once (a second run
    reads them from `dataset_prepared_path`), and one epoch is one step per bin."""
    import hellbender.data.pretokenized_packing as packing_module
    from tests.helpers import cli_train, trainer_state

    (tmp_path / "data").mkdir()
    _, documents, _ = pretokenized(tmp_path / "data", QWEN)
    data = documents.rows.to_list()
    measured = []
    original = packing_module.full_lengths

    def counting(rows, collator, cfg):
        measured.append(len(list(Path(cfg.dataset_prepared_path).glob("pretokenized-lengths-*.json"))))
        return original(rows, collator, cfg)

    monkeypatch.setattr(packing_module, "full_lengths", counting)
    entry = {"path": str(write_jsonl(tmp_path / "rows.jsonl", data)), "type": "multimodal_pretrain"}
    entry["image_base_dir"] = str(tmp_path / "data")
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        cfg = one_epoch_in_two_bins(
            tmp_path / run,
            datasets=[entry],
            skip_prepare_dataset=True,
            dataset_prepared_path=str(tmp_path / "prepared"),
        )
        cli_train(tmp_path / run, cfg)
        state = trainer_state(cfg["output_dir"])
        assert state["global_step"] == 2
        assert state["stateful_callbacks"]["TokenCounter"]["attributes"]["input_tokens"] == 77
    assert measured == [0, 1]  # the second run found the lengths the first one cached


def test_streamed_packed_cpt_killed_and_resumed_in_a_new_process_trains_the_same_bins(tmp_path, monkeypatch):
    """Streamed documents packed as they arrive: every bin holds consecutive rows. A `hellbender train` process killed
    (SIGKILL) after its step-2 checkpoint and resumed by a new process trains the same rows in the same bins with the
    same losses, and the new process reads no image file of a row trained before the checkpoint."""
    import json
    import os
    import subprocess
    import sys

    import yaml
    from PIL import Image

    from hellbender.models.tiny import tiny_model_dir
    from tests.conftest import REPO
    from tests.helpers import cli_train, logged_losses, record_training, trainer_state
    from tests.test_multimodal_pretrain import document, image_name

    (tmp_path / "img").mkdir()
    # Enough rows that the stream's read-ahead never starts a second pass (which reads row 0's image again).
    for i in range(48):
        Image.new("RGB", (32, 32), (5 * i, 255 - 5 * i, 90)).save(tmp_path / image_name(i))
    rows = write_jsonl(tmp_path / "stream.jsonl", [document(i) for i in range(48)])
    entry = {"path": str(rows), "type": "multimodal_pretrain", "image_base_dir": str(tmp_path)}
    tiny_model_dir(QWEN)  # built first: building it inside `train` reseeds torch

    def config(name: str) -> dict:
        return vlm_config(
            tmp_path / name,
            QWEN,
            datasets=[],
            pretraining_dataset=[entry],
            sample_packing=True,
            sequence_len=64,  # documents of 17-19 tokens: three to a bin
            micro_batch_size=1,
            max_steps=4,
            save_steps=2,
            adapter="lora",
            lora_target_linear=True,
            lora_dropout=0.1,  # exercises the restored RNG state
            auto_resume_from_checkpoints=True,
        )

    # The uninterrupted run, through `hellbender train` in this process.
    reference = config("ref")
    ref = record_training(monkeypatch.setattr)
    cli_train(tmp_path, reference, "ref.yml")
    monkeypatch.undo()
    bins = [batch_rows for batch_rows, _ in ref["trained"]]
    assert len(bins) == 4 and all(len(b) >= 2 and b == list(range(b[0], b[-1] + 1)) for b in bins), bins
    assert [b[0] for b in bins[1:]] == [b[-1] + 1 for b in bins[:-1]]  # consecutive bins of consecutive rows

    # The same run killed as step 3 begins (its batch already read), then resumed by a new process.
    resumed = config("resumed")
    path = tmp_path / "resumed.yml"
    path.write_text(yaml.safe_dump(resumed))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    killed = subprocess.run(
        [sys.executable, str(REPO / "tests" / "crash_run.py"), str(path), "--kill-before-step", "3"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    out = Path(resumed["output_dir"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    checkpoint = trainer_state(out / "checkpoint-2")
    assert checkpoint["stateful_callbacks"]["StreamPosition"]["attributes"] == {"rows_consumed": bins[1][-1] + 1}
    report = tmp_path / "resumed.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.stopped_run", str(path), "--record", str(report)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(report.read_text())

    # The same bins (rows, and the token ids of every packed row) after the resume as in the uninterrupted run.
    assert second["trained"] == ref["trained"][2:]
    # Stream positions, after the stream's shuffle: the collator recorded which images each one had.
    trained_before = {p for b in bins[:2] for row in b for p in ref["images_of_row"][str(row)]}
    trained_after = {p for b in bins[2:] for row in b for p in ref["images_of_row"][str(row)]}
    assert len(trained_before) == sum(map(len, bins[:2])) and trained_before <= set(ref["opened"])
    assert not trained_before & set(second["opened"]), sorted(trained_before & set(second["opened"]))
    assert trained_after <= set(second["opened"])  # the record sees the reads that do happen
    # The same losses at every step: steps 1-2 from the killed process's checkpoint, 3-4 from the new process.
    expected, got = logged_losses(reference["output_dir"]), logged_losses(out)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)


def test_streamed_bins_resumed_at_every_bin_boundary_are_the_uninterrupted_ones(tmp_path):
    """The bins are a function of the stream's order alone: a stream started at the row after any bin's last row (what
    a checkpoint records) yields exactly the bins that followed it, across passes (each shuffled with its own seed)
    and past a row dropped as too long."""
    from itertools import islice

    from hellbender.data.streaming import StreamingMultimodalDataset, StreamingPackedMultimodalDataset
    from hellbender.models.loading import load_tokenizer_and_processor

    data = cpt_rows(tmp_path, QWEN, many_images=True)  # rows of 39, 25 and 13 tokens, and one too long for a bin
    entry = {"path": str(data), "type": "multimodal_pretrain", "image_base_dir": str(tmp_path)}
    cfg = validate_config(
        vlm_config(tmp_path, QWEN, datasets=[], pretraining_dataset=[entry], sample_packing=True, sequence_len=64)
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)

    def bins(start_row: int, n: int) -> list[tuple[list[int], list[list[int]]]]:
        rows = StreamingMultimodalDataset(cfg, tokenizer, processor, start_row)
        packed = StreamingPackedMultimodalDataset(rows, cfg.sequence_len)
        return [
            ([d["stream_row"] for d in b["documents"]], [d["input_ids"] for d in b["documents"]])
            for b in islice(packed, n)
        ]

    reference = bins(0, 12)  # eight passes of the four rows, each shuffled its own way
    rows = [row for members, _ in reference for row in members]
    assert rows == sorted(set(rows))  # every bin holds the rows after the previous bin's, in stream order
    assert len(set(range(rows[-1] + 1)) - set(rows)) == (rows[-1] + 1) // 4  # each pass dropped its over-long row
    assert any(members[0] // 4 != members[-1] // 4 for members, _ in reference)  # a bin spanning two passes
    assert len({tuple(map(len, ids)) for _, ids in reference}) > 1
    for k in range(1, len(reference)):
        assert bins(reference[k - 1][0][-1] + 1, len(reference) - k) == reference[k:], k
