"""Sample packing (bins, packed rows, streamed packing) and the collator that turns rows into batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hellbender.data.collator import CausalLMCollator, forward_kwargs
from hellbender.data.packing import concat_documents, pack_buffered, pack_lengths, pack_stream

IGNORE = -100
PAD = 1


def check_bins(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


# --- pack_lengths -------------------------------------------------------------------------------------------


def test_pack_lengths_perfectly_packable_input_uses_the_minimum_number_of_bins():
    lengths = [5, 3, 8, 2, 7, 1, 4]  # 30 tokens, exactly three bins of 10: 8+2, 7+3, 5+4+1
    bins = pack_lengths(lengths, 10)
    check_bins(bins, lengths, 10)
    assert len(bins) == 3


def test_pack_lengths_random_rows_invariants_and_determinism():
    rng = random.Random(1234)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = pack_lengths(lengths, 128)
    check_bins(bins, lengths, 128)
    lower_bound = math.ceil(sum(lengths) / 128)
    assert len(bins) <= 11 / 9 * lower_bound + 1  # best-fit decreasing's worst-case bound
    assert pack_lengths(list(lengths), 128) == bins  # same input, same bins (the cache relies on it)


def test_pack_lengths_equal_lengths_are_deterministic():
    lengths = [3] * 10
    bins = pack_lengths(lengths, 9)
    check_bins(bins, lengths, 9)
    assert len(bins) == 4
    assert bins == pack_lengths(lengths, 9)


def test_pack_lengths_row_of_exactly_capacity_fits():
    bins = pack_lengths([10, 10, 4], 10)
    check_bins(bins, [10, 10, 4], 10)
    assert len(bins) == 3


def test_pack_lengths_row_longer_than_capacity_raises_naming_it():
    with pytest.raises(ValueError, match="row 1 has 11 tokens, more than the bin capacity 10"):
        pack_lengths([3, 11, 2], 10)


def test_pack_lengths_empty_input():
    assert pack_lengths([], 10) == []


# --- concat_documents ---------------------------------------------------------------------------------------


def test_concat_documents_masks_first_label_of_every_document():
    ids = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    labels = [[10, 11, 12], [IGNORE, 21], [IGNORE, IGNORE, 32, 33]]
    packed = concat_documents(ids, labels)
    assert packed == {
        "input_ids": [10, 11, 12, 20, 21, 30, 31, 32, 33],
        "labels": [IGNORE, 11, 12, IGNORE, 21, IGNORE, IGNORE, 32, 33],
        "seq_lens": [3, 2, 4],
    }


@pytest.mark.parametrize("in_order", [False, True], ids=["best-fit", "in-order"])
@pytest.mark.parametrize("with_targets", [False, True], ids=["tokens", "teacher-targets"])
def test_pack_dataset_builds_each_bin_as_its_documents_concatenated(in_order, with_targets):
    """The packed rows `pack_dataset` writes (in Arrow, a batch of bins at a time) are exactly `concat_documents` of
    each bin's rows, with the teacher's per-token targets moved with their tokens; more bins than one batch."""
    import datasets

    from hellbender.data.packing import pack_dataset, pack_lengths_in_order
    from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS

    rng = random.Random(3)
    rows = {"input_ids": [], "labels": [], "length": []}
    if with_targets:
        rows[TARGET_IDS], rows[TARGET_LOGPROBS] = [], []
    for _ in range(3500):
        n = rng.randint(1, 40)
        ids = [rng.randrange(2, 500) for _ in range(n)]
        rows["input_ids"].append(ids)
        rows["labels"].append([t if rng.random() < 0.7 else IGNORE for t in ids])
        rows["length"].append(n)
        if with_targets:
            rows[TARGET_IDS].append([[t, t + 1] if rng.random() < 0.8 else [] for t in ids])
            rows[TARGET_LOGPROBS].append([[-0.25, -1.5] if k else [] for k in rows[TARGET_IDS][-1]])
    features = {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "length": datasets.Value("int64"),
    }
    if with_targets:
        features[TARGET_IDS] = datasets.List(datasets.List(datasets.Value("int32")))
        features[TARGET_LOGPROBS] = datasets.List(datasets.List(datasets.Value("float32")))
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features(features))

    packed = pack_dataset(ds, 64, in_order=in_order)
    bins = (pack_lengths_in_order if in_order else pack_lengths)(rows["length"], 64)
    assert len(packed) == len(bins) > 1000  # several map batches
    for k in (0, 1, len(bins) // 2, len(bins) - 1):
        members = bins[k]
        expected = concat_documents([rows["input_ids"][i] for i in members], [rows["labels"][i] for i in members])
        assert {key: packed[k][key] for key in expected} == expected
        if with_targets:
            for key in (TARGET_IDS, TARGET_LOGPROBS):
                assert packed[k][key] == [position for i in members for position in rows[key][i]]
    assert packed.features["input_ids"] == datasets.List(datasets.Value("int64"))
    all_rows = packed.to_dict()
    assert sum(map(len, all_rows["input_ids"])) == sum(rows["length"])
    assert [n for lens in all_rows["seq_lens"] for n in lens] == [rows["length"][i] for b in bins for i in b]


# --- pack_stream --------------------------------------------------------------------------------------------


def doc(start: int, n: int) -> dict[str, list[int]]:
    ids = list(range(start, start + n))
    return {"input_ids": ids, "labels": list(ids)}


def test_pack_stream_fills_every_bin_and_continues_documents_in_order():
    docs = [doc(100, 2), doc(200, 2), doc(300, 12), doc(400, 1)]
    bins = list(pack_stream(iter(docs), 5))
    assert [b["input_ids"] for b in bins] == [
        [100, 101, 200, 201, 300],
        [301, 302, 303, 304, 305],
        [306, 307, 308, 309, 310],
        [311, 400],
    ]
    assert [b["seq_lens"] for b in bins] == [[2, 2, 1], [5], [5], [1, 1]]
    # Every piece is its own attention block: its first label is masked, the rest are the document's labels.
    assert [b["labels"] for b in bins] == [
        [IGNORE, 101, IGNORE, 201, IGNORE],
        [IGNORE, 302, 303, 304, 305],
        [IGNORE, 307, 308, 309, 310],
        [IGNORE, IGNORE],
    ]


def test_pack_stream_keeps_document_labels_inside_a_piece():
    docs = [{"input_ids": [1, 2, 3, 4], "labels": [IGNORE, IGNORE, 3, 4]}]
    assert list(pack_stream(iter(docs), 8)) == [
        {"input_ids": [1, 2, 3, 4], "labels": [IGNORE, IGNORE, 3, 4], "seq_lens": [4]}
    ]


def test_pack_stream_invariants_on_random_documents():
    rng = random.Random(7)
    docs = []
    start = 0
    for _ in range(200):
        n = rng.randint(1, 50)
        docs.append(doc(start, n))
        start += n
    capacity = 16
    bins = list(pack_stream(iter(docs), capacity))
    flat = [t for b in bins for t in b["input_ids"]]
    assert flat == list(range(start))  # nothing lost, duplicated or reordered
    assert all(len(b["input_ids"]) == capacity for b in bins[:-1])  # only the last bin may be short
    for b in bins:
        assert 0 < len(b["input_ids"]) <= capacity
        assert len(b["labels"]) == len(b["input_ids"])
        assert sum(b["seq_lens"]) == len(b["input_ids"])
        assert all(0 < n <= capacity for n in b["seq_lens"])


def test_pack_stream_empty_input_yields_nothing():
    assert list(pack_stream(iter([]), 8)) == []


def test_pack_stream_without_separate_documents_makes_each_bin_one_sequence():
    """`pretrain_multipack_attn: false`: one attention block per bin, and a document's first token is predicted from
    the end of the one before it (only the bin's first label, never a target, is masked)."""
    docs = [doc(100, 2), doc(200, 2), doc(300, 12), doc(400, 1)]
    bins = list(pack_stream(iter(docs), 5, separate_documents=False))
    assert [b["input_ids"] for b in bins] == [b["input_ids"] for b in pack_stream(iter(docs), 5)]
    assert [b["seq_lens"] for b in bins] == [[5], [5], [5], [2]]
    assert [b["labels"] for b in bins] == [
        [IGNORE, 101, 200, 201, 300],
        [IGNORE, 302, 303, 304, 305],
        [IGNORE, 307, 308, 309, 310],
        [IGNORE, 400],
    ]


def test_pack_buffered_packs_each_buffer_on_its_own_and_keeps_every_row_whole():
    rng = random.Random(3)
    rows = [doc(1000 * i, rng.randint(1, 9)) for i in range(40)]
    for row in rows[::3]:
        row["labels"][:2] = [IGNORE] * len(row["labels"][:2])  # a masked prompt
    bins = list(pack_buffered(iter(rows), 16, 8, random.Random(0)))
    assert bins == list(pack_buffered(iter(rows), 16, 8, random.Random(0)))  # the same for the same seed
    by_start = {row["input_ids"][0]: i for i, row in enumerate(rows)}
    seen = []
    for b in bins:
        assert len(b["input_ids"]) <= 16
        members, start = [], 0
        for n in b["seq_lens"]:
            row = rows[by_start[b["input_ids"][start]]]
            assert b["input_ids"][start : start + n] == row["input_ids"]
            assert b["labels"][start : start + n] == [IGNORE] + row["labels"][1:]
            members.append(by_start[row["input_ids"][0]])
            start += n
        assert len({i // 8 for i in members}) == 1  # all of one buffer of 8 rows
        seen += members
    assert sorted(seen) == list(range(40))
    # Buffers are served in stream order (within one, the bins come in the seeded random order).
    buffer_of_bin = [by_start[b["input_ids"][0]] // 8 for b in bins]
    assert buffer_of_bin == sorted(buffer_of_bin)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_bin_packed_as_one_sequence_scores_like_the_concatenated_text(tiny_model_path, attn):
    """`pretrain_multipack_attn: false` asks for plain causal attention over the whole bin: the collated bin gives
    every token the loss the concatenated documents get as one unmasked row."""
    from transformers import AutoModelForCausalLM

    from hellbender.data.collator import REAL_TOKENS_KEY

    docs = random_docs()
    (joined,) = list(pack_stream(iter(docs), 40, separate_documents=False))
    batch = CausalLMCollator(pad_token_id=PAD)([joined])
    batch.pop(REAL_TOKENS_KEY)
    labels = batch.pop("labels")
    assert batch["position_ids"].tolist() == [list(range(40))]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        packed = model.eval()(**batch, **forward_kwargs(batch)).logits
        plain = model(input_ids=torch.tensor([joined["input_ids"]])).logits
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    assert (labels[0, 1:] != IGNORE).all()  # every token after the first is trained, across documents


# --- collator -----------------------------------------------------------------------------------------------


def packed_rows():
    return [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 6, IGNORE, 8, 9], "seq_lens": [2, 3]},
        {"input_ids": [15, 16, 17], "labels": [IGNORE, 16, 17], "seq_lens": [3]},
    ]


def test_collator_packed_rows_get_restarting_positions_and_no_mask():
    """Every backend finds the documents from the restarting position ids, with the forward building no KV cache:
    a 4-D mask from the collator would reach every layer unchanged and undo sliding windows."""
    batch = CausalLMCollator(pad_token_id=PAD)(packed_rows())
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [15, 16, 17, PAD, PAD]]
    assert batch["labels"].tolist() == [[IGNORE, 6, IGNORE, 8, 9], [IGNORE, 16, 17, IGNORE, IGNORE]]
    # The padding after the last document restarts from zero: a block of its own.
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 0, 1]]
    assert "attention_mask" not in batch
    assert forward_kwargs(batch) == {"use_cache": False}
    assert batch["num_real_tokens"].tolist() == [5, 3]


def test_collator_unpacked_rows_right_padding_and_2d_mask():
    rows = [
        {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
        {"input_ids": [8], "labels": [8]},
        {"input_ids": [9, 10], "labels": [IGNORE, IGNORE]},
    ]
    batch = CausalLMCollator(pad_token_id=PAD)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD], [9, 10, PAD]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE], [IGNORE, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert "position_ids" not in batch
    assert batch["num_real_tokens"].tolist() == [3, 1, 2]
    assert batch["num_real_tokens"].tolist() == batch["attention_mask"].sum(dim=1).tolist()
    assert forward_kwargs(batch) == {}  # a masked batch needs nothing of the forward


def test_collator_pad_to_multiple_of():
    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}]
    batch = CausalLMCollator(pad_token_id=PAD, pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, PAD]]
    assert batch["labels"].tolist() == [[5, 6, 7, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert batch["num_real_tokens"].tolist() == [3]


# Two document sets: prompt-masked labels in one packed row, and plain documents in two packed rows, the second
# padded after its last document (padding is its own block).
PROMPT_MASKED_DOCS = [
    {"input_ids": [40, 41, 42, 43, 44, 45], "labels": [40, 41, 42, 43, 44, 45]},
    {"input_ids": [50, 51, 52, 53], "labels": [IGNORE, IGNORE, 52, 53]},
    {"input_ids": [60, 61, 62, 63, 64], "labels": [60, 61, 62, 63, 64]},
]


def random_docs() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (9, 14, 6, 11)]
    return [{"input_ids": d, "labels": list(d)} for d in docs]


@pytest.mark.parametrize(
    "docs, row_splits, trained",
    [
        pytest.param(PROMPT_MASKED_DOCS, [3], 5 + 2 + 4, id="prompt-masked-one-row"),
        pytest.param(random_docs(), [3, 1], 8 + 13 + 5 + 10, id="two-rows-padded"),
    ],
)
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
def test_packed_batch_gives_the_same_per_token_loss_as_unpacked(tiny_model_path, attn, docs, row_splits, trained):
    """The packed rows (restarting positions that transformers turns into per-layer masks: dense for SDPA and
    eager, a flex block mask for flex attention; masked first labels) must score every trained token exactly as the documents alone do. Forward passes get what
    the trainer adds (`forward_kwargs`). Flex attention runs uncompiled here (torch's reference kernel, forward only:
    torch 2.13 has no flex backward on CPU); compiling it with inductor takes minutes on a CI machine, and the
    masks under test are the same."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    from hellbender.data.collator import REAL_TOKENS_KEY, forward_kwargs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn, dtype=torch.float32).eval()

    def per_token_nll(batch, with_forward_kwargs=True):
        batch = dict(batch)
        batch.pop(REAL_TOKENS_KEY)
        labels = batch.pop("labels")
        extra = forward_kwargs(batch) if with_forward_kwargs else {}
        stance = torch.compiler.set_stance("force_eager") if attn == "flex_attention" else nullcontext()
        with torch.no_grad(), stance:
            logits = model(**batch, **extra).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        target = labels[:, 1:]
        keep = target != IGNORE
        return -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0][keep]

    collate = CausalLMCollator(pad_token_id=PAD)
    unpacked = per_token_nll(collate(docs))
    packed_rows, start = [], 0
    for n in row_splits:
        row_docs = docs[start : start + n]
        packed_rows.append(concat_documents([d["input_ids"] for d in row_docs], [d["labels"] for d in row_docs]))
        start += n
    assert start == len(docs)
    packed = per_token_nll(collate(packed_rows))
    assert unpacked.shape == packed.shape == (trained,)
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=1e-5)
    # With a KV cache transformers skips the packed-document detection: documents would see each other.
    leaked = per_token_nll(collate(packed_rows), with_forward_kwargs=False)
    assert (leaked - unpacked).abs().max() > 1e-2


def test_token_tensor_reads_lists_arrays_and_tensors_as_int64():
    import numpy as np

    from hellbender.data.collator import token_tensor

    ids = [5, -100, 2**40, 0]
    for values in (ids, np.array(ids, dtype=np.int64), torch.tensor(ids), np.array(ids[:2], dtype=np.int32)):
        out = token_tensor(values)
        assert out.dtype == torch.int64
        assert out.tolist() == [int(v) for v in values]
    assert token_tensor([]).shape == (0,)
