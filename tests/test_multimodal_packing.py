"""Sample packing of image+text chat rows (Qwen2.5-VL, Qwen3-VL, Gemma 4 with and without image tokens attending both
ways, LLaVA, Idefics3): a packed row of several image
documents computes what each document computes alone — the same logits for every token and the same LoRA gradients —
and other vision-language families are refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from hellbender.config import validate_config
from tests.conftest import write_jsonl
from tests.helpers import vlm_config
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN, QWEN3

# The families whose packing is checked here, with their test ids.
PACKABLE = pytest.mark.parametrize(
    "name, bidirectional",
    [(QWEN, False), (QWEN3, False), (GEMMA4, False), (GEMMA4, True), (LLAVA, False), (IDEFICS3, False)],
    ids=["qwen", "qwen3", "gemma4", "gemma4-bidirectional-images", "llava", "idefics3"],
)

# Max |logit difference| packed vs alone, fp32 CPU, measured: Qwen2.5-VL 3.0e-7, Qwen3-VL 4.8e-7, Gemma 4 8.0e-7,
# LLaVA 2.4e-7, Idefics3 1.8e-7.
# LoRA gradients: the language model's agree to a relative 2e-6 (Qwen2.5-VL) and 2e-6 (Gemma 4). The tiny Gemma 4's
# vision-tower adapters get no real gradient (1e-15 in float64, so 1e-7 of rounding noise in fp32): atol covers it.
# The models run in float64 (`lora_model`): in float32 a gradient near zero (Gemma 4's second vision layer, about 1e-6)
# is all rounding noise, and that noise differed by CPU (1.1e-6 on an AMD EPYC against the 1e-6 allowed).
LOGIT_TOLERANCE = 1e-9
# The language model's parameters (Idefics3 calls it `text_model`): every one of its adapters must get a gradient.
LANGUAGE_MODEL = re.compile(r".*\.(language|text)_model\.")


def documents(tmp_path):
    """Three conversations with one, two and one images of different sizes (different Qwen grids)."""
    from PIL import Image

    sizes = {"a.png": (32, 32), "b.png": (56, 28), "c.png": (28, 42), "d.png": (40, 40)}
    for seed, (name, size) in enumerate(sizes.items()):
        colour = (40 * seed + 30, 200 - 40 * seed, 90)
        Image.new("RGB", size, colour).save(tmp_path / name)

    def turn(images: list[str], question: str, answer: str) -> dict:
        parts = [{"type": "image", "path": i} for i in images] + [{"type": "text", "text": question}]
        return {
            "messages": [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
        }

    rows = [
        turn(["a.png"], "What colour is it?", "It is a warm red."),
        turn(["b.png", "c.png"], "Compare them.", "The first is wider than the second one."),
        turn(["d.png"], "Describe.", "A square."),
    ]
    return write_jsonl(tmp_path / "docs.jsonl", rows)


def prepared(tmp_path, name: str, packing: bool):
    from hellbender.data.batching import build_collator
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer_and_processor

    data = documents(tmp_path)
    cfg = validate_config(
        vlm_config(
            tmp_path,
            name,
            datasets=[{"path": str(data), "type": "chat_template", "image_base_dir": str(tmp_path)}],
            sequence_len=1024,
            sample_packing=packing,
            dataset_prepared_path=str(tmp_path / f"prepared-{packing}"),
        )
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    rows = prepare_datasets(cfg, tokenizer, processor).train
    return rows, build_collator(cfg, tokenizer, processor)


def lora_model(name: str, bidirectional_images: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from hellbender.models.tiny import tiny_model_dir

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir(name), dtype=torch.float64)
    if bidirectional_images:  # as the larger Gemma 4 models: image tokens see each other in sliding layers
        model.config.get_text_config().use_bidirectional_attention = "vision"
    # Random B matrices, so that the adapters change the forward and get gradients through every path.
    # Adapters on the language model's attention and on the vision encoder's: the linear layers by name (Gemma 4
    # wraps its vision projections, so `q_proj` there is the wrapper and `q_proj.linear` the layer).
    wanted = re.compile(
        r".*(language|text)_model.*\.(q_proj|v_proj)|.*(vision_tower|vision_model).*\.q_proj.*|.*visual.*\.qkv"
    )
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and wanted.fullmatch(n)]
    config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, config).eval()


def forward(model, batch: dict, packed_positions: bool = True):
    from hellbender.data.collator import REAL_TOKENS_KEY
    from hellbender.models.packed_vision import packed_vision_inputs

    inputs = {k: v for k, v in batch.items() if k not in (REAL_TOKENS_KEY, "labels")}
    # The collator's pixels are float32; the model is float64 (`lora_model`).
    inputs = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    if packed_positions:
        inputs.update(packed_vision_inputs(model, inputs))
    return model(**inputs, use_cache=False).logits


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


@PACKABLE
def test_a_packed_row_of_image_documents_computes_what_each_document_computes_alone(tmp_path, name, bidirectional):
    packed_rows, collator = prepared(tmp_path, name, packing=True)
    alone_rows, _ = prepared(tmp_path, name, packing=False)
    assert len(packed_rows) == 1 and len(packed_rows[0]["seq_lens"]) == 3  # all three documents in one bin
    row = packed_rows[0]
    assert row["seq_lens"] == sorted(alone_rows["length"], reverse=True)  # full lengths, image tokens included
    model = lora_model(name, bidirectional_images=bidirectional)

    batch = collator([row])
    assert "attention_mask" not in batch
    packed_logits = forward(model, batch)
    summed_loss(packed_logits, batch["labels"]).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    by_text = {doc["text"]: i for i, doc in enumerate(row["documents"])}
    starts = [sum(row["seq_lens"][:i]) for i in range(3)]
    worst = 0.0
    for alone in alone_rows:
        i = by_text[alone["text"]]
        one = collator.documents([alone])
        logits = forward(model, one)
        n = row["seq_lens"][i]
        assert torch.equal(batch["input_ids"][0, starts[i] : starts[i] + n], one["input_ids"][0])
        worst = max(worst, (packed_logits[0, starts[i] : starts[i] + n] - logits[0]).abs().max().item())
        summed_loss(logits, one["labels"]).backward()  # gradients add up over the three documents
    assert worst < LOGIT_TOLERANCE, worst
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is None:  # reached by no document (LLaVA's unread last vision layer)
            assert n not in packed_grads and not LANGUAGE_MODEL.match(n), n
        elif p.requires_grad:
            assert not LANGUAGE_MODEL.match(n) or p.grad.abs().sum() > 0, n
            # Relative to the tensor's largest gradient: elementwise, near-zero entries carry only rounding noise.
            scale = p.grad.abs().max().item()
            assert (packed_grads[n] - p.grad).abs().max().item() <= 1e-5 * scale + 1e-9, n

    if name in (QWEN, QWEN3) or bidirectional:  # the test can fail: without hellbender's packed inputs (each
        # document's own 3-D positions; Gemma 4's image blocks kept per document) the logits move
        wrong = forward(model, batch, packed_positions=False)
        assert (wrong - packed_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("attention", ["flash_attention_2", "flex_attention"])
def test_gemma4_with_bidirectional_image_attention_is_refused_where_hellbender_builds_no_masks(attention):
    """hellbender keeps a packed document's image blocks its own with masks for SDPA and eager attention only."""
    from hellbender.errors import ConfigError
    from hellbender.models.packed_vision import check_packable_vision_model

    model = lora_model(GEMMA4, bidirectional_images=True)
    check_packable_vision_model(model)  # SDPA, as loaded
    model.config.get_text_config()._attn_implementation = attention
    with pytest.raises(
        ConfigError,
        match=f"use_bidirectional_attention: vision.*attn_implementation: {attention}|"
        f"attn_implementation: {attention}.*use_bidirectional_attention: vision",
    ):
        check_packable_vision_model(model)


@pytest.mark.parametrize("name", [QWEN3, LLAVA, IDEFICS3], ids=["qwen3", "llava", "idefics3"])
def test_a_packable_family_loads_with_packing(tmp_path, name):
    from hellbender.models.loading import load_model, load_tokenizer_and_processor

    cfg = validate_config(vlm_config(tmp_path, name, sample_packing=True))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    assert load_model(cfg, tokenizer).config.model_type in ("qwen3_vl", "llava", "idefics3")


def test_packing_another_vision_family_is_refused_by_name(tmp_path, monkeypatch):
    """Loading a vision-language model with packing refuses, naming it, a family whose packed rows are not checked
    above: the tiny LLaVA with its entry taken out of the list, and LLaVA-NeXT (its images cut into a varying number of
    crops by size)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from hellbender.errors import ConfigError
    from hellbender.models import packed_vision
    from hellbender.models.loading import load_model, load_tokenizer_and_processor

    monkeypatch.delitem(packed_vision.PACKABLE_VISION_FAMILIES, "llava")
    cfg = validate_config(vlm_config(tmp_path, LLAVA, sample_packing=True))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    with pytest.raises(ConfigError, match="`llava` vision-language model is not supported yet"):
        load_model(cfg, tokenizer)
    llava_next = SimpleNamespace(config=AutoConfig.for_model("llava_next"))  # its config is all the check reads
    with pytest.raises(ConfigError, match="`llava_next` vision-language model is not supported yet"):
        packed_vision.check_packable_vision_model(llava_next)


# --- training end to end -------------------------------------------------------------------------------------------


def packed_run(tmp_path, name: str, **overrides) -> dict:
    """LoRA on the bundled coloured-squares rows (about 110 tokens each with their image), packed 4 to a 512-token
    bin: 60 rows in 15 bins."""
    return vlm_config(
        tmp_path, name, adapter="lora", sample_packing=True, sequence_len=512, micro_batch_size=1, **overrides
    )


def test_hellbender_train_with_packed_image_rows_lowers_the_loss_and_resumes_exactly(tmp_path):
    from hellbender.train.run import train
    from tests.helpers import StopAt, cli_train, logged_losses

    common = dict(max_steps=6, save_steps=3, learning_rate=1e-2, lora_dropout=0.1)  # dropout: the RNG is restored
    reference = packed_run(tmp_path / "ref", QWEN, **common)
    cli_train(tmp_path, reference)
    expected = logged_losses(reference["output_dir"])
    assert sorted(expected) == list(range(1, 7))
    # Measured: 6.28, 6.09, 5.90, 5.82, 5.72, 5.46.
    assert expected[6] < expected[1] - 0.5 and expected[5] + expected[6] < 0.95 * (expected[1] + expected[2]), expected

    cfg = validate_config(packed_run(tmp_path / "resumed", QWEN, auto_resume_from_checkpoints=True, **common))
    train(cfg, callbacks=[StopAt(3)])
    train(cfg)  # resumes from checkpoint-3, in the middle of the packed bins
    got = logged_losses(cfg.output_dir)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)
