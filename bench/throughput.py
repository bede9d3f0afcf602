"""Training throughput and memory: plain transformers + PEFT against hellbender, on the same model and data.

One invocation runs each selected workload twice, (a) `baseline`: what a competent user writes with plain
transformers + PEFT (Trainer, TrainingArguments with bf16, non-reentrant gradient checkpointing, pre-tokenized
rows, no saving), and (b) `hellbender`: the same hyper-parameters as a hellbender config, trained through
`hellbender.train.run.train`. Each (workload, variant) runs in its own subprocess, so no memory or allocator state
leaks from one into the next; the parent collects their JSON and prints ONE markdown table.

Workloads (`--workloads`, default W1,W2,W3):
  W1  Llama-3-8B shape, LoRA r=16 alpha=32 on q,k,v,o,gate,up,down, seq 2048, micro-batch 2, checkpointing.
  W2  Llama-3.2-1B shape (tied embeddings), full fine-tune, AdamW, seq 2048, micro-batch 4, checkpointing.
      Micro-batch 4 (8192 tokens per step) is a common 1B SFT setting; it peaks at 19.3 GiB on an H100 (measured),
      so the comparison is about speed, not about fitting the card.
  W3  Gemma-4-E2B shape with its vision tower, LoRA on the language model only, 400 synthetic image+text chat rows
      (one 256x256 PNG each: 256 soft tokens), micro-batch 4, checkpointing. The baseline collator runs the same
      processor on the same rows.
  W4  longest trainable sequence of the 8B shape with QLoRA (NF4, double quant, bf16 compute), micro-batch 1,
      checkpointing: doubling from 8192, then bisection to ~5 %, each trial a fresh subprocess running one
      optimizer step (`--w4-steps`); the budget `--w4-budget-s` is split evenly between the two variants.
  W7  OLMoE-1B-7B shape at half depth (8 layers, 64 experts, 8 active), LoRA r=16 alpha=32 on q,k,v,o and the
      experts' fused weights (PEFT `target_parameters` on the baseline; `gate_proj`/`up_proj`/`down_proj` reach them
      in hellbender), seq 2048, micro-batch 2, checkpointing; transformers' default experts path (grouped_mm on a
      GPU). MFU counts the routed share of the expert weights.
  cpu data preparation only: hellbender's `prepare_datasets` (chat_template rows, sample packing) on `--rows`
      synthetic chat rows, timed with a fresh cache; rows/s and tokens/s.

All models have random weights, are built directly on the GPU in bf16 and saved once per shape under `--workdir`
(default /tmp/hb-bench; the 8B model is shared by W1 and W4 and reused by later invocations) with hellbender's tiny
tokenizer: every variant loads the same saved directory. Token ids stay below the tiny tokenizer's 512 entries
(hellbender's `pretokenized` format refuses ids outside the tokenizer); with frozen or fully trained embeddings
alike, which ids are used does not change the compute.

Measurements:
- step time: wall time between consecutive `on_step_end` calls, after `torch.cuda.synchronize()`, so it covers the
  data loader and collator (image processing for W3), forward, backward and optimizer step. Steps 1..`--warmup`
  (default 5 of `--steps` 25) are skipped. tokens/s is the median over the steady steps of tokens / step time. The
  share of step time before `on_step_begin` (fetching and collating the batch) is reported as "waits for the batch".
- `--free-running`: the steady steps timed as one span instead, synchronised only at its start and at the last
  step's end (before anything saved there; with `--epoch`, at the run's end), so each side's own waits for the GPU
  (reading a loss, a count, a flag) cost what they cost in a real run, where nothing synchronises every step.
  tokens/s is the span's tokens over its wall time; no per-step figures.
- tokens per step: counted in a forward pre-hook on the trained model from the batch's `attention_mask`: micro-batch
  x seq for W1/W2 (fixed length, no padding), the real tokens (image tokens included) for W3.
- peak memory: `torch.cuda.max_memory_allocated` / `max_memory_reserved` from the start of training (stats reset
  in `on_train_begin`, when the model already sits on the GPU) to its end.
- MFU (model FLOPs utilisation), median over steady steps of model FLOPs / step time / the card's dense bf16 peak
  (H100 SXM and H200: 989 TFLOPS; looked up from `torch.cuda.get_device_name()`, or `--peak-tflops`). Convention,
  per token of a row of n tokens, with N = weights of every linear layer of the language model (output head
  included, input embeddings excluded: a lookup is no matmul) and N_t = those of them that train:
    linear layers: forward 2N, backward 2N for the activation gradients + 2 N_t for the weight gradients,
                   so 6N for full fine-tuning and 4N + 2 N_t for LoRA / QLoRA (N counts the LoRA A/B weights too);
    attention:     12 * d_attn * ctx per layer (PaLM's 12*L*H*Q*T: forward 4, backward 8; the causal mask is not
                   halved), d_attn = heads x head_dim of that layer, ctx = n, or min(n, window) for sliding layers;
    vision tower (W3; frozen, so forward only): per image P = soft tokens x pooling^2 patches,
                   2 N_vision P + 4 d_vision P^2 per layer.
  Activation checkpointing's recomputed forward is not credited (that would be hardware FLOPs utilisation).

Run on a CUDA machine (see bench/README.md): `python3 bench/throughput.py [--workloads W1,W2,W3,W4,cpu]
[--steps 25] [--warmup 5] [--json out.json]`. `--tiny` (alias `--dry-run`) shrinks every model to toy size (hidden
64, 2 layers, vocab 512, seq 128, 6 steps, 2 warm-up) and runs on CPU when there is no GPU: a smoke check of every
code path (memory and MFU then read "n/a").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the E2B text shape is shared with the sibling memory-slope benchmark
    sys.path.insert(0, str(HERE))

GIB = 1024**3
SEED = 0
VARIANTS = ("baseline", "hellbender", "hellbender+")  # hellbender+: hellbender with `--hb-also` on top
GPU_WORKLOADS = ("W1", "W2", "W3", "W4", "W7")
# `--gc frozen` (passed to the children in this variable): freeze and disable Python's automatic garbage collection
# when training begins, to see how much of the step-time spread it causes.
GC_EXPERIMENT_ENV = "HB_BENCH_GC"
PROFILE_ENV = "HB_BENCH_PROFILE"  # `--profile-steps A-B`, passed to the children
FREE_RUNNING_ENV = "HB_BENCH_FREE_RUNNING"  # `--free-running`, passed to the children
TRACE_ENV = "HB_BENCH_TRACE"  # `--profile-trace DIR`, passed to the children
ALL_WORKLOADS = (*GPU_WORKLOADS, "cpu")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# W7's expert weights (transformers 5's fused experts): what LORA_TARGETS' MLP projections name in an OLMoE layer.
OLMOE_EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# The tiny tokenizer's special tokens are ids 0-3 and it has 512 entries; random ids stay inside [10, 500).
TOKEN_IDS = (10, 500)
MODEL_SPEC_FILE = "bench_model.json"
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")

# Dense bf16 tensor-core peaks (no sparsity), first substring match of the device name wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)

# Issue 7's W1 baseline, measured on one H200 with torch 2.11 / transformers 5.17 / peft 0.21.0.
W1_REFERENCE = {
    "device": "H200",
    "with_checkpointing": {"tokens_per_s": 7079, "peak_allocated_gib": 22.4},
    "without_checkpointing": {"tokens_per_s": 10099, "peak_allocated_gib": 48.0},
}

# ---------------------------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------------------------

LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128_256,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    max_position_embeddings=131_072,
)
LLAMA32_1B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128_256,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    max_position_embeddings=131_072,
)
# OLMoE-1B-7B's shape (64 experts, 8 active per token) at half its depth: 3.7B parameters, 0.7B active per token.
OLMOE_1B_7B_HALF: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=50_304,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TINY_OLMOE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    max_position_embeddings=131_072,
)

# Gemma 4's vision tower: the defaults of Gemma4VisionConfig in transformers 5.24 (those of E2B's vision config),
# written out so a changed default in another release cannot change the benchmark's shape.
E2B_VISION: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=10 * 1024,
)
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    pooling_kernel_size=3,
    position_embedding_size=256,
)
# E2B's image processor: 16 px patches, at most 280 soft tokens of 3x3 pooled patches. Any image is resized (aspect
# kept) to at most 280 * 9 patches with sides in multiples of 48 px: a square image gives 16x16 = 256 soft tokens.
E2B_IMAGES = {"patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3}
TINY_IMAGES = {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 3}  # 70: the smallest budget allowed


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    family: str  # "llama" or "gemma4-vlm"
    model_key: str  # directory under <workdir>/models; W1 and W4 share the 8B model
    shape: dict[str, Any]
    adapter: str | None  # "lora", "qlora" or None (full fine-tuning)
    seq: int  # tokens per row (causal); the `sequence_len` cap for W3
    micro_batch: int
    learning_rate: float
    image_px: int = 0  # W3: side of the square PNGs
    rows: int = 0  # W3: synthetic image+text rows


def workload(name: str, tiny: bool) -> Workload:
    import gemma4_e2b_memory_slope as slope

    if name in ("W1", "W4"):
        return Workload(
            name,
            "Llama-3-8B shape, " + ("QLoRA NF4" if name == "W4" else "LoRA r16"),
            "llama",
            "tiny-llama-untied" if tiny else "llama3-8b",
            TINY_LLAMA | {"tie_word_embeddings": False} if tiny else LLAMA3_8B,
            "qlora" if name == "W4" else "lora",
            seq=128 if tiny else 2048,
            micro_batch=1 if name == "W4" else 2,
            learning_rate=1e-4,
        )
    if name == "W2":
        return Workload(
            name,
            "Llama-3.2-1B shape, full FT",
            "llama",
            "tiny-llama-tied" if tiny else "llama32-1b",
            TINY_LLAMA | {"tie_word_embeddings": True} if tiny else LLAMA32_1B,
            None,
            seq=128 if tiny else 2048,
            micro_batch=4,
            learning_rate=2e-5,
        )
    if name == "W3":
        shape = {
            "text": slope.TINY_TEXT if tiny else slope.E2B_TEXT,
            "vision": TINY_VISION if tiny else E2B_VISION,
            "images": TINY_IMAGES if tiny else E2B_IMAGES,
        }
        return Workload(
            name,
            "Gemma-4-E2B shape + vision, LoRA r16",
            "gemma4-vlm",
            "tiny-gemma4-vlm" if tiny else "gemma4-e2b-vlm",
            shape,
            "lora",
            # The cap only: rows are one image (256 soft tokens; tiny: 64) and a few hundred text tokens.
            seq=1024 if tiny else 2048,
            micro_batch=4,
            learning_rate=1e-4,
            image_px=32 if tiny else 256,
            rows=48 if tiny else 400,
        )
    if name == "W7":
        return Workload(
            name,
            "OLMoE-1B-7B shape (8 of 16 layers), LoRA r16 on attention and experts",
            "olmoe",
            "tiny-olmoe" if tiny else "olmoe-1b-7b-half",
            TINY_OLMOE if tiny else OLMOE_1B_7B_HALF,
            "lora",
            seq=128 if tiny else 2048,
            micro_batch=2,
            learning_rate=1e-4,
        )
    raise ValueError(f"unknown workload {name}")


@dataclass(frozen=True)
class Paths:
    workdir: Path

    def model(self, w: Workload) -> Path:
        return self.workdir / "models" / w.model_key

    def causal_rows(self, seq: int, rows: int) -> Path:
        return self.workdir / "data" / f"pretokenized-seq{seq}-rows{rows}.jsonl"

    def vlm_rows(self, w: Workload) -> Path:
        return self.workdir / "data" / f"{w.model_key}-px{w.image_px}-rows{w.rows}" / "rows.jsonl"

    def chat_rows(self, rows: int) -> Path:
        return self.workdir / "data" / f"chat-rows{rows}.jsonl"

    def run(self, label: str) -> Path:
        return self.workdir / "runs" / label

    def prepared(self) -> Path:
        return self.workdir / "prepared"


# ---------------------------------------------------------------------------------------------------------------
# Data (written by the parent, before any child starts, so both variants read the same files)
# ---------------------------------------------------------------------------------------------------------------


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals sorted by start: the time a GPU ran any kernel."""
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary sibling and rename, so an interrupted run never leaves a half file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    write(staging)
    os.replace(staging, path)


def pretokenized_rows(path: Path, rows: int, seq: int) -> Path:
    if path.is_file():
        return path

    def write(target: Path) -> None:
        rng = random.Random(SEED)
        with target.open("w") as f:
            for _ in range(rows):
                ids = [rng.randrange(*TOKEN_IDS) for _ in range(seq)]
                f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")

    write_atomically(path, write)
    return path


COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (250, 140, 30),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
SHAPE_KINDS = ("square", "circle", "triangle")
FILLER = (
    "The shapes do not overlap, and each one has a clear, solid outline.",
    "Nothing else is drawn in the picture, so the layout is easy to describe.",
    "The background is a single flat colour without any texture or gradient.",
    "Counting from the left, the shapes appear in the order listed above.",
    "None of the shapes is rotated; their edges run parallel to the borders.",
    "The colours are saturated, which makes every shape stand out from the background.",
    "If the picture were cropped to its centre, at least one shape would still be visible.",
    "A caption for this image could simply list the shapes with their colours.",
)


def draw_shapes(rng: random.Random, size: int) -> tuple[Any, str]:
    """A PNG-ready image with one to three coloured shapes, and a sentence per shape describing it."""
    from PIL import Image, ImageDraw

    names = list(COLOURS)
    background = rng.choice(names)
    image = Image.new("RGB", (size, size), COLOURS[background])
    draw = ImageDraw.Draw(image)
    sentences = [f"The background is {background}."]
    for _ in range(rng.randint(1, 3)):
        colour = rng.choice([n for n in names if n != background])
        kind = rng.choice(SHAPE_KINDS)
        side = rng.randint(size // 6, size // 3)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        box = (x, y, x + side, y + side)
        if kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        elif kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        else:
            draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=COLOURS[colour])
        where = ("top" if y < size / 3 else "bottom" if y > size / 2 else "middle") + (
            " left" if x < size / 3 else " right" if x > size / 2 else ""
        )
        sentences.append(f"There is a {colour} {kind} in the {where} of the picture.")
    return image, " ".join(sentences)


def vlm_rows(path: Path, rows: int, size: int) -> Path:
    """`rows` chat rows, each a user turn with one image and a question and a descriptive assistant answer of
    varying length (so batches need padding, as real data does)."""
    if path.is_file():
        return path

    def write(target: Path) -> None:
        rng = random.Random(SEED)
        images = target.parent / "images"
        images.mkdir(parents=True, exist_ok=True)
        with target.open("w") as f:
            for i in range(rows):
                image, description = draw_shapes(rng, size)
                name = f"images/{i:04d}.png"
                image.save(target.parent / name)
                answer = " ".join([description, *rng.choices(FILLER, k=rng.randint(1, 10))])
                user = [{"type": "image", "path": name}, {"type": "text", "text": "Describe this picture in detail."}]
                messages = [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")

    write_atomically(path, write)
    return path


VOCABULARY = (
    "the model data train token batch memory layer result value people time year way day thing man world life hand "
    "part child eye woman place work week case point government company number group problem fact be have do say get "
    "make go know take see come think look want give use find tell ask feel try leave call good new first last long "
    "great little own other old right big high different small large next early young important few public bad same "
    "able to of in for on with at by from up about into over after beneath under above because although while if "
    "then 2024 17 3.5 42 100 (see below) [note] e.g. i.e. -- ; : ! ?"
)
WORDS = VOCABULARY.split()


def chat_rows(path: Path, rows: int) -> Path:
    """Synthetic chat SFT rows: an optional system turn, then one to three user/assistant exchanges."""
    if path.is_file():
        return path

    def sentence(rng: random.Random, words: int) -> str:
        text = " ".join(rng.choices(WORDS, k=words))
        return text[0].upper() + text[1:] + "."

    def write(target: Path) -> None:
        rng = random.Random(SEED)
        with target.open("w") as f:
            for _ in range(rows):
                messages = []
                if rng.random() < 0.3:
                    messages.append({"role": "system", "content": sentence(rng, rng.randint(5, 20))})
                for _ in range(rng.randint(1, 3)):
                    messages.append({"role": "user", "content": sentence(rng, rng.randint(6, 60))})
                    answer = " ".join(sentence(rng, rng.randint(5, 25)) for _ in range(rng.randint(1, 12)))
                    messages.append({"role": "assistant", "content": answer})
                f.write(json.dumps({"messages": messages}) + "\n")

    write_atomically(path, write)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Models (built in a child process: the parent never touches the GPU)
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def model_spec(w: Workload, tiny: bool) -> dict[str, Any]:
    return {"family": w.family, "shape": w.shape, "tiny": tiny}


def model_is_built(model_dir: Path, spec: dict[str, Any]) -> bool:
    marker = model_dir / MODEL_SPEC_FILE
    return marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(spec))


def build_gemma4_processor(tokenizer: Any, images: dict[str, int]) -> Any:
    """A Gemma 4 processor with the given image settings around the tiny Gemma 4 tokenizer (as hellbender's tiny VLM
    builds it, minus torchvision: `Gemma4ProcessorWithoutVideo` saves a directory `AutoProcessor` loads)."""
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    from hellbender.models.fixes.gemma4 import Gemma4ProcessorWithoutVideo
    from hellbender.models.tiny_vlm.gemma4 import GEMMA4_CHAT_TEMPLATE

    extra_special_tokens = list(tokenizer.extra_special_tokens)
    processor = Gemma4ProcessorWithoutVideo(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil(**images),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=GEMMA4_CHAT_TEMPLATE,
        image_seq_length=images["max_soft_tokens"],
    )
    # The processor's __init__ replaces the tokenizer's extra special tokens with `<|video|>` alone; restore them.
    tokenizer.add_special_tokens({"extra_special_tokens": extra_special_tokens})
    return processor


def gemma4_vlm_config(w: Workload) -> tuple[Any, Any]:
    """The Gemma 4 vision-language workload's model config and its processor (around the tiny Gemma 4 tokenizer)."""
    import gemma4_e2b_memory_slope as slope
    from transformers import Gemma4Config, Gemma4VisionConfig

    from hellbender.models.tiny_vlm import gemma4 as tiny_gemma4

    tokenizer = tiny_gemma4.build_tokenizer()
    processor = build_gemma4_processor(tokenizer, w.shape["images"])
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma4Config(
        text_config=slope.text_config(w.shape["text"], tokenizer),
        vision_config=Gemma4VisionConfig(**w.shape["vision"]),
        audio_config=None,
        image_token_id=ids(tiny_gemma4.IMAGE_TOKEN),
        boi_token_id=ids(tiny_gemma4.BOI_TOKEN),
        eoi_token_id=ids(tiny_gemma4.EOI_TOKEN),
        video_token_id=ids(tiny_gemma4.VIDEO_TOKEN),
        audio_token_id=ids(tiny_gemma4.AUDIO_TOKEN),
        boa_token_id=ids(tiny_gemma4.BOA_TOKEN),
        eoa_token_index=ids(tiny_gemma4.EOA_TOKEN),
        tie_word_embeddings=True,
    )
    return config, processor


def build_model(w: Workload, target: Path, tiny: bool) -> dict[str, Any]:
    """Save `w`'s model with random weights (built on the GPU in bf16 when there is one) and its tokenizer (and
    processor) into `target`; returns facts about it."""
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(SEED)
    if w.family in ("llama", "olmoe"):
        from transformers import LlamaConfig, LlamaForCausalLM, OlmoeConfig, OlmoeForCausalLM

        from hellbender.models.tiny import build_tiny_tokenizer

        config_class, model_class = (
            (LlamaConfig, LlamaForCausalLM) if w.family == "llama" else (OlmoeConfig, OlmoeForCausalLM)
        )
        tokenizer = build_tiny_tokenizer()
        config = config_class(
            **w.shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
        )
        with default_dtype(dtype), device:
            model = model_class(config)
        saved = [tokenizer]
    else:
        from transformers import Gemma4ForConditionalGeneration

        config, processor = gemma4_vlm_config(w)
        with default_dtype(dtype), device:
            model = Gemma4ForConditionalGeneration(config)
        saved = [processor]  # writes the tokenizer files too
    facts = {"parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype).removeprefix("torch.")}
    model.save_pretrained(target)
    for item in saved:
        item.save_pretrained(target)
    return facts


# ---------------------------------------------------------------------------------------------------------------
# Measuring: FLOPs per row, and a callback that times steps and counts tokens
# ---------------------------------------------------------------------------------------------------------------

VISION_PARTS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio", "multi_modal_projector")


def _out_features(module: Any) -> int | None:
    """Output width of a linear layer, of a PEFT / clipped wrapper around one, or None."""
    for candidate in (module, getattr(module, "linear", None), getattr(module, "base_layer", None)):
        width = getattr(candidate, "out_features", None)
        if isinstance(width, int):
            return width
    return None


@dataclass
class FlopModel:
    """Model FLOPs of one training row (see the module docstring for the convention)."""

    lm_params: int = 0
    lm_trainable: int = 0
    vision_params: int = 0
    vision_trainable: int = 0
    lm_attention: list[tuple[int, int | None]] = field(default_factory=list)  # (d_attn, sliding window) per layer
    vision_attention: list[int] = field(default_factory=list)  # d_attn per vision layer
    pooling: int = 1

    @classmethod
    def of(cls, model: Any) -> FlopModel:
        import torch

        flops = cls()
        for name, module in model.named_modules():
            vision = any(part in name for part in VISION_PARTS)
            if isinstance(module, torch.nn.Linear):  # bitsandbytes' Linear4bit is one too; PEFT wrappers are not
                n = module.in_features * module.out_features
                trainable = n if module.weight.requires_grad else 0
                if vision:
                    flops.vision_params, flops.vision_trainable = (
                        flops.vision_params + n,
                        flops.vision_trainable + trainable,
                    )
                else:
                    flops.lm_params, flops.lm_trainable = flops.lm_params + n, flops.lm_trainable + trainable
            elif type(module).__name__.endswith("Experts"):  # 3-D expert weights: only the routed share computes
                config = model.config
                share = config.num_experts_per_tok / config.num_experts
                n = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 3)
                flops.lm_params += int(n * share)
            elif type(module).__name__.endswith("Attention") and hasattr(module, "q_proj"):
                width = _out_features(module.q_proj)
                if width is None:
                    continue
                if vision:
                    flops.vision_attention.append(width)
                else:
                    window = getattr(module, "sliding_window", None)
                    flops.lm_attention.append((width, window if isinstance(window, int) else None))
        vision_config = getattr(getattr(model, "config", None), "vision_config", None)
        flops.pooling = getattr(vision_config, "pooling_kernel_size", 1) or 1
        return flops

    def row(self, tokens: int, image_tokens: int) -> float:
        total = tokens * (4.0 * self.lm_params + 2.0 * self.lm_trainable)
        total += sum(12.0 * tokens * (min(tokens, w) if w else tokens) * d for d, w in self.lm_attention)
        if image_tokens:  # one image per row in W3: all its soft tokens come from one image
            patches = image_tokens * self.pooling**2
            if self.vision_trainable:
                total += patches * (4.0 * self.vision_params + 2.0 * self.vision_trainable)
                total += sum(12.0 * patches * patches * d for d in self.vision_attention)
            else:
                total += patches * 2.0 * self.vision_params
                total += sum(4.0 * patches * patches * d for d in self.vision_attention)
        return total


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def environment() -> dict[str, Any]:
    import platform

    import peft
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / GIB if cuda else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def peak_rss_gib() -> float:
    """This process's peak resident host memory (offloaded activations live there, in pinned pages)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class ProfiledSteps:
    """`--profile-steps A-B`: the PyTorch profiler over steps A..B; per step, how long the GPU ran kernels against
    the step's wall time (a GPU idle inside the step means the host did not keep it fed), and the top host and device
    operators over those steps."""

    def __init__(self, first: int, last: int, label: str = "run"):
        self.first, self.last, self.label = first, last, label
        self._profile: Any = None
        self._ranges: dict[int, Any] = {}

    def step_begins(self, step: int) -> None:
        import torch

        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
        if self._profile is not None and step <= self.last:
            self._ranges[step] = torch.profiler.record_function(f"hb_step_{step}")
            self._ranges[step].__enter__()

    def step_ends(self, step: int) -> None:
        if self._profile is None or step not in self._ranges:
            return
        self._ranges[step].__exit__(None, None, None)
        if step == self.last:
            self._profile.__exit__(None, None, None)
            self.report()
            self.export()
            self._profile = None

    def export(self) -> None:
        """`--profile-trace DIR`: the profiled steps as a gzipped Chrome trace, one file per run (its label), for
        reading where the GPU waited (`chrome://tracing`, Perfetto, or a script over its events)."""
        folder = os.environ.get(TRACE_ENV)
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9._-]+", "-", self.label)
            self._profile.export_chrome_trace(str(Path(folder) / f"{name}.json.gz"))

    def report(self) -> None:
        from torch.autograd import DeviceType

        events = self._profile.events()
        steps = {e.name: e for e in events if e.name.startswith("hb_step_") and e.device_type == DeviceType.CPU}
        kernels = sorted(  # the step ranges are mirrored on the device too: not kernels
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == DeviceType.CUDA and not e.name.startswith("hb_step_")
        )
        print("| step | wall ms | GPU busy ms | GPU idle ms | kernels | host time outside operators ms |")
        print("|---|---|---|---|---|---|")
        for name, event in sorted(steps.items(), key=lambda item: int(item[0].rsplit("_", 1)[1])):
            window = event.time_range
            inside = [(a, b) for a, b in kernels if window.start <= a < window.end]
            busy = busy_time(inside)
            wall = window.end - window.start
            print(
                f"| {name[8:]} | {wall / 1e3:.1f} | {busy / 1e3:.1f} | {(wall - busy) / 1e3:.1f} | {len(inside)} "
                f"| {event.self_cpu_time_total / 1e3:.1f} |"
            )
        averages = self._profile.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        print(averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))


class StepRecorder:
    """Times every optimizer step and counts its tokens and model FLOPs; prints one progress line per step."""

    def __init__(self, label: str, total_steps: int, warmup: int, peak: float | None, features: dict[str, Any]):
        import torch

        self.label, self.total_steps, self.warmup, self.peak = label, total_steps, warmup, peak
        self.cuda = torch.cuda.is_available()
        self.features = features
        self.steps: list[dict[str, Any]] = []
        # Per micro-batch since the last step end: each row's tokens and image tokens, as tensors on the batch's device
        # (read back at the step's end, or at the run's end when free-running).
        self.rows: list[tuple[Any, Any]] = []
        # `--free-running`: no synchronisation between the steady steps, only at their start and the last one's end.
        self.free_running = os.environ.get(FREE_RUNNING_ENV) == "1"
        self._steady_start: float | None = None
        self.steady_wall_s: float | None = None
        self.flops: FlopModel | None = None
        self.params: dict[str, int] = {}
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None
        self._last: float | None = None
        self._begin = 0.0
        self._image_token_id: int | None = None
        self._pad_id: int | None = None
        self._gc_s = 0.0  # time inside Python's garbage collector since the last step end
        self._gc_started = 0.0
        steps = os.environ.get(PROFILE_ENV)
        self.profiled = ProfiledSteps(*map(int, steps.split("-")), label) if steps else None

    def _time_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_started

    def _sync(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def _count_rows(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch

        if not module.training or not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            lengths = mask.sum(dim=1)
        elif self._pad_id is not None and kwargs.get("position_ids") is not None:
            # Packed rows carry no mask: the padding after a row's last document is the pad id.
            lengths = (ids != self._pad_id).sum(dim=1)
        else:
            lengths = torch.full((ids.shape[0],), ids.shape[1])
        images = (ids == self._image_token_id).sum(dim=1) if self._image_token_id is not None else lengths * 0
        self.rows.append((lengths, images))  # tensors: counting makes the host wait for nothing

    @staticmethod
    def _read_rows(rows: list[tuple[Any, Any]]) -> list[tuple[int, int]]:
        return [
            (int(n), int(i)) for lengths, images in rows for n, i in zip(lengths.tolist(), images.tolist(), strict=True)
        ]

    def on_train_begin(self, args: Any, model: Any) -> None:
        import torch

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._image_token_id = getattr(base.config, "image_token_id", None)
        self._pad_id = getattr(base.config.get_text_config(), "pad_token_id", None)
        self.flops = FlopModel.of(model)
        self.params = {
            "total": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }
        self.features.setdefault("attention", getattr(base.config, "_attn_implementation", None))
        self.features.setdefault("optimizer", str(getattr(args.optim, "value", args.optim)))
        self.features.setdefault("bf16", bool(args.bf16))
        # Registered on the module the Trainer calls: PEFT's inner models are called through `.forward`, no hooks.
        model.register_forward_pre_hook(self._count_rows, with_kwargs=True)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if os.environ.get(GC_EXPERIMENT_ENV) == "frozen":  # experiment: no automatic collection during the steps
            gc.collect()
            gc.freeze()
            gc.disable()
            self.features["gc"] = "frozen and disabled"
        gc.callbacks.append(self._time_gc)
        print(
            f"[{self.label}] training: {count(self.params['trainable'])} of {count(self.params['total'])} parameters "
            f"train; {self.features}",
            flush=True,
        )

    def on_step_begin(self, step: int) -> None:
        if self.free_running:
            if step == self.warmup + 1:
                self._steady_start = self._sync()
            return
        # The GPU is idle here (synchronised at the last step end): this sync only timestamps the batch's arrival.
        self._begin = self._sync()
        if self.profiled is not None:
            self.profiled.step_begins(step)
        if self._last is None:  # the first step; later steps are timed from the previous step's end
            self._last = self._begin

    def on_step_end(self, step: int) -> None:
        import torch

        if self.free_running:
            self.steps.append({"step": step, "rows": self.rows})
            self.rows = []
            if step == self.total_steps:  # before the step's own end: a checkpoint saved at the last step
                self.steady_wall_s = self._sync() - (self._steady_start or 0.0)
            return
        now = self._sync()
        if self.profiled is not None:
            self.profiled.step_ends(step)
        seconds, self._last = now - (self._last or now), now
        rows = self._read_rows(self.rows)
        tokens = sum(n for n, _ in rows)
        flops = sum(self.flops.row(n, i) for n, i in rows) if self.flops else 0.0
        self.rows = []
        # `compute_s`: forward, backward and optimizer step; the rest of `seconds` is fetching and collating the batch.
        record = {
            "step": step,
            "seconds": seconds,
            "compute_s": now - self._begin,
            "gc_s": self._gc_s,
            "tokens": tokens,
            "flops": flops,
        }
        self._gc_s = 0.0
        self.steps.append(record)
        line = f"[{self.label}] step {step}/{self.total_steps}: {seconds:.3f} s, {tokens / seconds:,.0f} tok/s"
        if self.peak:
            line += f", MFU {flops / seconds / (self.peak * 1e12):.1%}"
        if self.cuda:
            line += f", peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB"
        line += f", host {peak_rss_gib():.1f} GiB"
        print(line + (" (warm-up)" if step <= self.warmup else ""), flush=True)

    def on_train_end(self) -> None:
        import torch

        end = self._sync()
        if self.free_running and self._steady_start is not None:
            if self.steady_wall_s is None:  # `--epoch`: the number of steps was not known in advance
                self.steady_wall_s = end - self._steady_start
            for record in self.steps:
                rows = self._read_rows(record.pop("rows"))
                record["tokens"] = sum(n for n, _ in rows)
                record["flops"] = sum(self.flops.row(n, i) for n, i in rows) if self.flops else 0.0
        if self.cuda:
            self.peak_allocated = torch.cuda.max_memory_allocated()
            self.peak_reserved = torch.cuda.max_memory_reserved()

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class Recorder(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                recorder.on_train_begin(args, model)

            def on_step_begin(self, args, state, control, **kwargs):
                recorder.on_step_begin(state.global_step + 1)

            def on_step_end(self, args, state, control, **kwargs):
                recorder.on_step_end(state.global_step)

            def on_train_end(self, args, state, control, **kwargs):
                recorder.on_train_end()

        return Recorder()

    def summary(self) -> dict[str, Any]:
        steady = [s for s in self.steps if s["step"] > self.warmup] or self.steps
        result: dict[str, Any] = {
            "steps": self.steps,
            "steady_steps": len(steady),
            "params": self.params,
            "features": self.features,
            "peak_tflops": self.peak,
            "peak_allocated_gib": self.peak_allocated / GIB if self.peak_allocated is not None else None,
            "peak_reserved_gib": self.peak_reserved / GIB if self.peak_reserved is not None else None,
            "peak_host_gib": peak_rss_gib(),
            "all_tokens": sum(s["tokens"] for s in self.steps),
        }
        if self.free_running:
            result["free_running"] = True
            if self.steady_wall_s and steady:  # one span, synchronised at its two ends only
                tokens = sum(s["tokens"] for s in steady)
                result["tokens_per_s"] = tokens / self.steady_wall_s
                result["step_s"] = self.steady_wall_s / len(steady)
                result["tokens_per_step"] = statistics.median(s["tokens"] for s in steady)
                if self.peak:
                    result["mfu"] = sum(s["flops"] for s in steady) / self.steady_wall_s / (self.peak * 1e12)
            return result
        # Every step, warm-up included: with `--epoch`, the wall time of one pass over the rows.
        result["all_steps_s"] = sum(s["seconds"] for s in self.steps)
        if steady:
            result["tokens_per_s"] = statistics.median(s["tokens"] / s["seconds"] for s in steady)
            result["step_s"] = statistics.median(s["seconds"] for s in steady)
            result["tokens_per_step"] = statistics.median(s["tokens"] for s in steady)
            if len(steady) >= 2:  # the spread of step times (issue: QLoRA's steps swing from one to the next)
                deciles = statistics.quantiles([s["seconds"] for s in steady], n=10)
                result["step_p10_s"], result["step_p90_s"] = deciles[0], deciles[-1]
            result["gc_s_per_step"] = statistics.mean(s["gc_s"] for s in steady)
            result["data_share"] = sum(s["seconds"] - s["compute_s"] for s in steady) / sum(
                s["seconds"] for s in steady
            )
            if self.peak:
                result["mfu"] = statistics.median(s["flops"] / s["seconds"] / (self.peak * 1e12) for s in steady)
        return result


# ---------------------------------------------------------------------------------------------------------------
# The two variants
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One (workload, variant) training run, as a child process sees it."""

    workload: Workload
    variant: str
    paths: Paths
    steps: int
    seq: int
    data: Path
    cuda: bool

    @property
    def label(self) -> str:
        return f"{self.workload.name} {self.variant}" + (f" seq {self.seq}" if self.workload.name == "W4" else "")

    @property
    def model_dir(self) -> Path:
        return self.paths.model(self.workload)

    @property
    def output_dir(self) -> Path:
        return self.paths.run(f"{self.workload.name}-{self.variant}-seq{self.seq}")


def baseline_arguments(job: Job) -> Any:
    from transformers import TrainingArguments

    w = job.workload
    return TrainingArguments(
        output_dir=str(job.output_dir),
        per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=1,
        max_steps=job.steps or -1,  # 0: `--epoch`, one pass over the rows
        num_train_epochs=1,
        learning_rate=w.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=job.cuda,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=job.steps + 1000,  # as in hellbender's config: no loss read-back (a GPU sync) mid-run
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=SEED,
    )


def baseline_lora(w: Workload) -> Any:
    from peft import LoraConfig

    targets: list[str] | str = list(LORA_TARGETS)
    if w.family == "gemma4-vlm":  # the language model's projections only, as a user targets them with PEFT
        targets = r".*language_model.*\.(" + "|".join(LORA_TARGETS) + ")"
    if w.family == "olmoe":  # the experts are 3-D parameters, which PEFT reaches through `target_parameters`
        return LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS[:4]), task_type="CAUSAL_LM",
            target_parameters=list(OLMOE_EXPERT_WEIGHTS),
        )  # fmt: skip
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")


@dataclass
class ChatImageCollator:
    """The baseline's VLM collator: render each conversation with the processor's chat template, open its images,
    run the processor on the batch, and train every real non-image token."""

    processor: Any
    image_root: Path
    image_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from PIL import Image

        texts = [self.processor.apply_chat_template(row["messages"], tokenize=False) for row in rows]
        images = [
            [
                Image.open(self.image_root / part["path"]).convert("RGB")
                for message in row["messages"]
                for part in message["content"]
                if part.get("type") == "image"
            ]
            for row in rows
        ]
        batch = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        labels[batch["input_ids"] == self.image_token_id] = -100
        batch["labels"] = labels
        return batch


def plain_processor(model_dir: Path) -> Any:
    """`AutoProcessor`, as a user loads it. Without torchvision `Gemma4Processor` cannot be built (its video
    processor needs it); hellbender's loader then builds the same processor minus videos, for both variants."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except (ImportError, ValueError):
        from hellbender.models.fixes.gemma4 import load_processor

        return load_processor(model_dir)


def train_baseline(job: Job, recorder: StepRecorder) -> None:
    import torch
    from transformers import Trainer, default_data_collator

    w = job.workload
    dtype = torch.bfloat16 if job.cuda else torch.float32
    recorder.features.update(checkpointing="transformers, non-reentrant")
    if w.family == "gemma4-vlm":
        from transformers import AutoModelForImageTextToText

        processor = plain_processor(job.model_dir)
        model = AutoModelForImageTextToText.from_pretrained(job.model_dir, dtype=dtype, attn_implementation="sdpa")
        rows = [json.loads(line) for line in job.data.read_text().splitlines()]
        collator: Callable = ChatImageCollator(processor, job.data.parent, model.config.image_token_id)
    else:
        from transformers import AutoModelForCausalLM

        quantization = None
        if w.adapter == "qlora":
            from transformers import BitsAndBytesConfig

            quantization = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
                bnb_4bit_quant_storage=torch.bfloat16,
            )
        model = AutoModelForCausalLM.from_pretrained(
            job.model_dir,
            dtype=dtype,
            attn_implementation="sdpa",
            quantization_config=quantization,
            device_map={"": 0} if quantization else None,
        )
        rows = []
        for line in job.data.read_text().splitlines():
            ids = torch.tensor(json.loads(line)["input_ids"])
            rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
        collator = default_data_collator
    if w.adapter == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    if w.adapter:
        from peft import get_peft_model

        model = get_peft_model(model, baseline_lora(w))
    trainer = Trainer(
        model=model,
        args=baseline_arguments(job),
        train_dataset=rows,
        data_collator=collator,
        callbacks=[recorder.callback()],
    )
    trainer.train()


def hellbender_raw_config(job: Job, overrides: dict[str, Any]) -> dict[str, Any]:
    w = job.workload
    raw: dict[str, Any] = {
        "base_model": str(job.model_dir),
        "sequence_len": job.seq,
        "excess_length_strategy": "raise",  # no row may vanish silently: both variants must see the same rows
        "sample_packing": False,
        "micro_batch_size": w.micro_batch,
        "gradient_accumulation_steps": 1,
        **({"max_steps": job.steps} if job.steps else {"num_epochs": 1}),  # 0: `--epoch`
        "learning_rate": w.learning_rate,
        "lr_scheduler": "constant",
        "gradient_checkpointing": True,
        "bf16": job.cuda,
        "save_steps": job.steps + 1000,  # no checkpoint during the run (the final model is saved after timing)
        "logging_steps": job.steps + 1000,
        "memory_watchdog": "off",
        "seed": SEED,
        "output_dir": str(job.output_dir),
        "dataset_prepared_path": str(job.paths.prepared()),
    }
    if w.family == "gemma4-vlm":
        raw["processor_type"] = "AutoProcessor"
        raw["datasets"] = [{"path": str(job.data), "type": "chat_template"}]
    else:
        raw["datasets"] = [{"path": str(job.data), "type": "pretokenized", "ds_type": "jsonl"}]
    if w.adapter:
        raw.update(
            adapter=w.adapter, lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=list(LORA_TARGETS)
        )
    raw.update(overrides)
    return raw


def auto_choices(cfg: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The values the planner chose for the keys `overrides` set to `auto`."""
    return {key: getattr(cfg, key) for key, value in overrides.items() if value == "auto"}


def train_hellbender(job: Job, recorder: StepRecorder, overrides: dict[str, Any]) -> None:
    from hellbender.config import validate_config
    from hellbender.plan.auto import choose
    from hellbender.train.run import train

    # `auto` values are chosen by the planner, as `hellbender train` chooses them (for this machine's GPU).
    cfg = validate_config(hellbender_raw_config(job, overrides), choose_auto=choose)
    mode = "hellbender, non-reentrant" + (", offload" if cfg.gradient_checkpointing == "offload" else "")
    recorder.features.update(checkpointing=mode if cfg.gradient_checkpointing else "off")
    kernels = sorted(k for k, v in cfg.model_dump().items() if k.startswith("liger_") and v)
    if kernels:
        recorder.features["kernels"] = ",".join(kernels)
    if overrides:
        recorder.features["overrides"] = overrides
    chosen = auto_choices(cfg, overrides)
    if chosen:
        recorder.features["chosen"] = chosen
    code = train(cfg, callbacks=[recorder.callback()]).get("exit_code")
    if code:  # diverged or stopped: no steady span to time
        raise SystemExit(f"[{job.label}] hellbender stopped the run (exit code {code}); its message is above")


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or any(m in str(exc) for m in OOM_MARKERS)


def run_job(job: Job, args: argparse.Namespace, warmup: int) -> dict[str, Any]:
    if job.variant != "baseline":  # hellbender's allocator default, set as `hellbender train` sets it: before CUDA
        from hellbender.plan.allocator import set_default_allocator_settings

        set_default_allocator_settings()
    env = environment()
    features: dict[str, Any] = {}
    recorder = StepRecorder(job.label, job.steps, warmup, peak_tflops(env["device"], args.peak_tflops), features)
    shutil.rmtree(job.output_dir, ignore_errors=True)  # never resume from an earlier run's checkpoints
    started = time.perf_counter()
    result: dict[str, Any] = {"workload": job.workload.name, "variant": job.variant, "seq": job.seq, **env}
    try:
        if job.variant == "baseline":
            train_baseline(job, recorder)
        else:
            also = args.hb_also if job.variant == "hellbender+" else []
            train_hellbender(job, recorder, parse_overrides(args.hb_set + also))
        result["ok"] = True
    except Exception as exc:
        if not (job.workload.name == "W4" and is_oom(exc)):
            raise
        result.update(ok=False, reason="oom", message=str(exc).splitlines()[0][:300])
        print(f"[{job.label}] out of memory", flush=True)
    finally:
        shutil.rmtree(job.output_dir, ignore_errors=True)
    result.update(recorder.summary(), wall_s=time.perf_counter() - started)
    return result


def parse_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--hb-set and --hb-also take KEY=VALUE, not {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The cpu workload: hellbender's data preparation
# ---------------------------------------------------------------------------------------------------------------


def run_cpu_prepare(args: argparse.Namespace, paths: Paths, data: Path) -> dict[str, Any]:
    """Time `prepare_datasets` (load, tokenize, shuffle, pack, save) on fresh caches (this process's datasets cache
    is a fresh directory too: the parent sets HF_DATASETS_CACHE)."""
    import hellbender.data.prepare as prepare
    from hellbender.config import validate_config
    from hellbender.models.loading import load_tokenizer

    scratch = Path(tempfile.mkdtemp(prefix="cpu-prepare-", dir=paths.workdir))
    raw = {
        "base_model": "hellbender/tiny-llama",
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "sequence_len": 2048,
        "sample_packing": True,
        "dataset_num_proc": args.procs,
        "dataset_prepared_path": str(scratch / "prepared"),
        "output_dir": str(scratch / "out"),
    }
    if args.tokenizer:
        raw["tokenizer_config"] = args.tokenizer
    cfg = validate_config(raw)
    tokenizer = load_tokenizer(cfg)
    phases: dict[str, float] = {"load": 0.0, "tokenize": 0.0, "pack": 0.0}

    def timed(name: str, function: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                phases[name] += time.perf_counter() - started

        return wrapper

    # Phase timers wrap the module-level names `prepare` calls (nothing in src/ changes); `tokenize` includes `load`.
    originals = {name: getattr(prepare, name) for name in ("load_rows", "tokenize_entries", "pack_dataset")}
    prepare.load_rows = timed("load", originals["load_rows"])
    prepare.tokenize_entries = timed("tokenize", originals["tokenize_entries"])
    prepare.pack_dataset = timed("pack", originals["pack_dataset"])
    try:
        print(f"[cpu] preparing {data.name} with {cfg.dataset_num_proc or 1} process(es) ...", flush=True)
        started = time.perf_counter()
        prepared = prepare.prepare_datasets(cfg, tokenizer, processor=None)
        seconds = time.perf_counter() - started
    finally:
        for name, function in originals.items():
            setattr(prepare, name, function)
        shutil.rmtree(scratch, ignore_errors=True)
    stats = prepared.stats
    train = stats["train"]
    bins = stats["packed_bins"] or 0
    result = {
        "workload": "cpu",
        "variant": "hellbender prepare",
        "ok": True,
        "seconds": seconds,
        "rows_in": train["rows_in"],
        "rows_kept": train["rows_kept"],
        "tokens": train["tokens"],
        "packed_bins": bins,
        "fill": train["tokens"] / (bins * cfg.sequence_len) if bins else None,
        "rows_per_s": train["rows_in"] / seconds,
        "tokens_per_s": train["tokens"] / seconds,
        "phases_s": {
            "load": phases["load"],
            "tokenize": phases["tokenize"] - phases["load"],
            "pack": phases["pack"],
            "other (shuffle, save, cache)": seconds - phases["tokenize"] - phases["pack"],
        },
        "tokenizer": args.tokenizer or "hellbender/tiny-llama (byte-level BPE, 512 tokens)",
        "processes": cfg.dataset_num_proc or 1,
        **environment(),
    }
    print(
        f"[cpu] {result['rows_in']:,} rows, {result['tokens']:,} tokens in {seconds:.1f} s: "
        f"{result['rows_per_s']:,.0f} rows/s, {result['tokens_per_s']:,.0f} tokens/s",
        flush=True,
    )
    return result


# ---------------------------------------------------------------------------------------------------------------
# Child entry point
# ---------------------------------------------------------------------------------------------------------------


def child_main(args: argparse.Namespace) -> None:
    """Run one piece of work and write its JSON to `--_result`."""
    warnings.simplefilter("ignore", FutureWarning)  # deprecation chatter of transformers 5.x aliases
    import transformers

    transformers.logging.set_verbosity_error()
    paths = Paths(args.workdir)
    tiny = args.tiny
    if tiny and not cuda_available():
        import torch

        # Toy models gain nothing from a second thread, and on a shared CPU a busy neighbour process makes torch's
        # threads wait on each other: one thread keeps the smoke check's timings from jumping 30x.
        torch.set_num_threads(1)
    result: dict[str, Any]
    if args._child == "build":
        w = workload(args._workload, tiny)
        target = paths.model(w)
        staging = target.with_name(f".{target.name}.building")
        shutil.rmtree(staging, ignore_errors=True)
        print(f"[build {w.model_key}] building {w.title} with random weights ...", flush=True)
        started = time.perf_counter()
        facts = build_model(w, staging, tiny)
        (staging / MODEL_SPEC_FILE).write_text(json.dumps(model_spec(w, tiny)))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        result = {"ok": True, **facts, "seconds": time.perf_counter() - started}
        print(
            f"[build {w.model_key}] {facts['parameters'] / 1e9:.2f}B parameters, {result['seconds']:.0f} s", flush=True
        )
    elif args._child == "run":
        w = workload(args._workload, tiny)
        job = Job(w, args._variant, paths, args._steps, args._seq, Path(args._data), cuda_available())
        result = run_job(job, args, warmup=args._warmup)
    elif args._child == "cpu":
        result = run_cpu_prepare(args, paths, Path(args._data))
    else:
        raise SystemExit(f"unknown child kind {args._child}")
    Path(args._result).write_text(json.dumps(result, indent=2))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------------------
# Parent: orchestration, the W4 search, the table
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Runner:
    """Starts child processes of this script and collects their JSON."""

    args: argparse.Namespace
    paths: Paths

    @classmethod
    def for_script(
        cls, workdir: Path, tiny: bool = False, peak_tflops: float | None = None, hb_set: list[str] | None = None
    ) -> Runner:
        """A runner for another bench script: its children see the options this script's parent would forward."""
        args = argparse.Namespace(
            workdir=workdir,
            tiny=tiny,
            peak_tflops=peak_tflops,
            procs=None,
            tokenizer=None,
            hb_set=hb_set or [],
            hb_also=[],
        )
        return cls(args, Paths(workdir))

    def child(self, kind: str, label: str, extra: list[str], timeout: float | None = None) -> dict[str, Any]:
        result_dir = self.paths.workdir / "results"
        result_dir.mkdir(parents=True, exist_ok=True)
        result_file = result_dir / f"{label.replace(' ', '-')}.json"
        result_file.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), *self.forwarded(), "--_child", kind]
        command += ["--_result", str(result_file), *extra]
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait on the hub
        env.setdefault("TQDM_DISABLE", "1")  # one progress line per step is ours; no progress bars
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one card: the Trainer would wrap the model in DataParallel
        env.setdefault("HF_DATASETS_OFFLINE", "1")
        env.setdefault("HF_DATASETS_CACHE", str(self.paths.workdir / "hf-datasets"))
        env.setdefault("HELLBENDER_CACHE", str(self.paths.workdir / "hellbender-cache"))  # the cpu tokenizer
        if kind == "cpu":  # a fresh datasets cache, so the JSON-to-Arrow conversion is timed too
            env["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="hf-datasets-", dir=self.paths.workdir)
        started = time.perf_counter()
        try:
            completed = subprocess.run(command, env=env, timeout=timeout, check=False)
            rc: int | str = completed.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if kind == "cpu":
                shutil.rmtree(env["HF_DATASETS_CACHE"], ignore_errors=True)
        if rc == 0 and result_file.is_file():
            return json.loads(result_file.read_text())
        reason = "timeout" if rc == "timeout" else f"exit code {rc}"
        print(f"[{label}] failed: {reason} (its output is above)", flush=True)
        return {"ok": False, "reason": reason, "wall_s": time.perf_counter() - started}

    def forwarded(self) -> list[str]:
        a = self.args
        out = ["--workdir", str(a.workdir)]
        out += ["--tiny"] * a.tiny
        out += ["--peak-tflops", str(a.peak_tflops)] if a.peak_tflops else []
        out += ["--procs", str(a.procs)] if a.procs else []
        out += ["--tokenizer", a.tokenizer] if a.tokenizer else []
        for item in a.hb_set:
            out += ["--hb-set", item]
        for item in a.hb_also:
            out += ["--hb-also", item]
        return out

    def ensure_model(self, w: Workload) -> bool:
        if model_is_built(self.paths.model(w), model_spec(w, self.args.tiny)):
            print(f"[build {w.model_key}] reusing {self.paths.model(w)}", flush=True)
            return True
        return bool(self.child("build", f"build {w.model_key}", ["--_workload", w.name]).get("ok"))

    def train(self, w: Workload, variant: str, steps: int, warmup: int, seq: int, data: Path, **kw: Any) -> dict:
        extra = ["--_workload", w.name, "--_variant", variant, "--_steps", str(steps), "--_warmup", str(warmup)]
        extra += ["--_seq", str(seq), "--_data", str(data)]
        label = f"{w.name} {variant}" + (f" seq {seq}" if w.name == "W4" else "")
        result = self.child("run", label, extra, **kw)
        result.setdefault("workload", w.name)
        result.setdefault("variant", variant)
        return result


def round_to(value: float, step: int) -> int:
    return max(step, int(value) // step * step)


def w4_search(runner: Runner, w: Workload, variant: str, budget_s: float) -> dict[str, Any]:
    """Longest sequence for which one training step of `variant` completes: doubling from `--w4-start`, then
    bisection until the bracket is within `--w4-precision` (and `--w4-granularity` tokens). Every trial is a fresh
    subprocess; a trial that would not fit the remaining budget is not started."""
    args = runner.args
    deadline = time.monotonic() + budget_s
    ok, bad, seq = 0, None, args.w4_start
    trials: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    stopped = "converged"
    last_duration = 0.0
    while True:
        left = deadline - time.monotonic()
        if left < max(30.0, 1.1 * last_duration):
            stopped = "budget"
            break
        data = pretokenized_rows(runner.paths.causal_rows(seq, args.w4_steps), args.w4_steps, seq)
        started = time.monotonic()
        # With two or more steps the first is warm-up (kernel tuning, the allocator's growth): 1.2-2x the next one.
        warmup = 1 if args.w4_steps > 1 else 0
        result = runner.train(w, variant, args.w4_steps, warmup, seq, data, timeout=min(args.w4_trial_timeout_s, left))
        last_duration = time.monotonic() - started
        data.unlink(missing_ok=True)  # long rows are big; each length is used once per variant
        fits = bool(result.get("ok"))
        reason = "fits" if fits else result.get("reason", "failed")
        trials.append(
            {
                "seq": seq,
                "result": reason,
                "seconds": last_duration,
                "peak_gib": result.get("peak_allocated_gib"),
                "peak_host_gib": result.get("peak_host_gib"),
            }
        )
        peak = f", peak {result['peak_allocated_gib']:.1f} GiB" if result.get("peak_allocated_gib") else ""
        print(f"[W4 {variant}] seq {seq:,}: {reason} ({last_duration:.0f} s{peak})", flush=True)
        if fits:
            ok, best = seq, result
        elif reason == "timeout" and left < args.w4_trial_timeout_s:  # cut by the budget, not by this length
            stopped = "budget"
            break
        elif reason in ("oom", "timeout") or ok:
            # A crash above a length that fitted (a CUDA error instead of an OOM exception) also bounds the search;
            # a crash at the first length is a bug, not a limit.
            bad = seq
        else:
            stopped = f"error ({reason})"
            break
        if bad is None:
            if seq * 2 > args.w4_max_seq:
                stopped = "max"
                break
            seq *= 2
            continue
        if bad - ok <= max(args.w4_granularity, args.w4_precision * ok):
            break
        seq = round_to((ok + bad) / 2, args.w4_granularity)
        if not ok < seq < bad:
            break
    return {
        "workload": "W4",
        "variant": variant,
        "ok": ok > 0,
        "max_seq": ok,
        "first_failing_seq": bad,
        "stopped": stopped,
        "trials": trials,
        "peak_allocated_gib": best.get("peak_allocated_gib") if best else None,
        "peak_reserved_gib": best.get("peak_reserved_gib") if best else None,
        # The longest trial's steps after the first (its only step when it ran one).
        "step_s": best.get("step_s") if best else None,
        "tokens_per_s": best.get("tokens_per_s") if best else None,
        "features": best.get("features", {}) if best else {},
        "params": best.get("params", {}) if best else {},
        **{k: best[k] for k in ("device", "torch", "transformers", "peft", "gpu_memory_gib") if best and k in best},
    }


def bitsandbytes_usable() -> str | None:
    """Why W4 cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (run bench/setup_gpu.sh on the GPU machine)"
    try:
        import torch

        if not torch.cuda.is_available():  # only imports torch; no CUDA context in the parent
            return "QLoRA (bitsandbytes NF4) needs a CUDA GPU"
    except ImportError:
        return "torch is not importable"
    return None


def fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "—"


def count(n: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.1f}{suffix}"
    return f"{n:,.0f}"


def features_text(result: dict[str, Any]) -> str:
    f = dict(result.get("features") or {})
    parts = [str(v) if k != "overrides" else f"overrides {v}" for k, v in f.items() if k not in ("bf16",)]
    if result.get("free_running"):
        parts.append("free-running (synchronised at the steady span's ends only)")
    if result.get("data_share") is not None:
        parts.append(f"{result['data_share']:.0%} of step time waits for the batch")
    if result.get("step_p10_s"):
        p10, p90 = result["step_p10_s"], result["step_p90_s"]
        parts.append(f"steps p10 {p10:.3f} s / p90 {p90:.3f} s (spread {p90 / p10:.2f}x)")
    if result.get("gc_s_per_step") is not None:
        parts.append(f"garbage collection {result['gc_s_per_step'] * 1e3:.1f} ms/step")
    if result.get("all_steps_s") is not None:
        parts.append(
            f"{len(result.get('steps') or [])} steps, {result['all_tokens']:,} tokens in {result['all_steps_s']:.1f} s"
        )
    params = result.get("params") or {}
    if params.get("trainable"):
        parts.append(f"{count(params['trainable'])} of {count(params['total'])} parameters train")
    return "; ".join(parts).replace("|", "/")


def markdown_table(results: list[dict[str, Any]], titles: dict[str, str]) -> str:
    header = (
        "| workload | variant | tokens/s | peak alloc (GiB) | peak reserved (GiB) | MFU | tokens/s hb/base "
        "| peak alloc hb/base | max seq (W4) | features |"
    )
    lines = [header, "|" + "---|" * 10]
    by_key = {(r["workload"], r["variant"]): r for r in results}
    for r in results:
        w, v = r["workload"], r["variant"]
        name = f"{w} {titles.get(w, '')}".strip()
        base = by_key.get((w, "baseline"), {}) if v.startswith("hellbender") else {}
        if not r.get("ok") and "trials" not in r:
            reason = str(r.get("reason", "?"))
            status = "skipped" if reason.startswith("skipped") else "failed"
            lines.append(f"| {name} | {v} | {status} | | | | | | | {reason.removeprefix('skipped: ')} |")
            continue
        if w == "cpu":
            phases = ", ".join(f"{k} {s:.1f} s" for k, s in r["phases_s"].items())
            notes = (
                f"{r['rows_per_s']:,.0f} rows/s; {r['rows_in']:,} rows ({r['rows_kept']:,} kept), {r['tokens']:,} "
                f"tokens -> "
                f"{r['packed_bins']:,} bins ({fmt(r['fill'], '.1%')} full) in {r['seconds']:.1f} s ({phases}); "
                f"{r['processes']} process(es); tokenizer {r['tokenizer']}"
            )
            lines.append(f"| {name} | {v} | {r['tokens_per_s']:,.0f} | n/a | n/a | n/a | — | — | — | {notes} |")
            continue
        if w == "W4":
            # Bracket [fits, fails): converged means within --w4-precision; otherwise say why the search stopped.
            max_seq = f"{r['max_seq']:,}" if r.get("max_seq") else "none fits"
            if r.get("first_failing_seq"):
                max_seq += f" (fails at {r['first_failing_seq']:,})"
            if r.get("stopped") != "converged":
                max_seq += f"; stopped: {r.get('stopped')}"
            if base.get("max_seq"):
                max_seq += f"; {ratio(r.get('max_seq'), base.get('max_seq'))} of baseline"
            lines.append(
                f"| {name} | {v} | — | {fmt(r.get('peak_allocated_gib'), '.1f')} "
                f"| {fmt(r.get('peak_reserved_gib'), '.1f')} | — | — | — | {max_seq} "
                f"| {features_text(r)}; {len(r.get('trials', []))} trials |"
            )
            continue
        tok_ratio = ratio(r.get("tokens_per_s"), base.get("tokens_per_s")) if base else "—"
        mem_ratio = ratio(r.get("peak_allocated_gib"), base.get("peak_allocated_gib")) if base else "—"
        lines.append(
            f"| {name} | {v} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('peak_allocated_gib'), '.1f')} "
            f"| {fmt(r.get('peak_reserved_gib'), '.1f')} | {fmt(r.get('mfu'), '.1%')} | {tok_ratio} | {mem_ratio} "
            f"| — | {features_text(r)} |"
        )
    return "\n".join(lines)


def parent_main(args: argparse.Namespace) -> int:
    if args.gc == "frozen":
        os.environ[GC_EXPERIMENT_ENV] = "frozen"  # read by the children, which inherit the environment
    if args.profile_steps:
        os.environ[PROFILE_ENV] = args.profile_steps
    if args.free_running:
        os.environ[FREE_RUNNING_ENV] = "1"
    if args.profile_trace:
        os.environ[TRACE_ENV] = str(args.profile_trace)
    selected = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(selected) - set(ALL_WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads: {', '.join(unknown)} (choose from {', '.join(ALL_WORKLOADS)})")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants takes {', '.join(VARIANTS)}")
    if args.documents and ("baseline" in variants or args.documents <= 0):
        raise SystemExit("--documents takes a positive length and runs hellbender's variants only (it packs the rows)")
    steps = 0 if args.epoch else args.steps or (6 if args.tiny else 25)  # 0: one epoch
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    if steps and warmup >= steps:
        raise SystemExit(f"--warmup ({warmup}) must be below --steps ({steps})")
    if args.tiny:
        args.w4_start = min(args.w4_start, 128)
        args.w4_max_seq = min(args.w4_max_seq, 1024)
        args.w4_granularity = min(args.w4_granularity, 64)
    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = Paths(args.workdir)
    runner = Runner(args, paths)
    if any(w in GPU_WORKLOADS for w in selected) and not args.tiny and not cuda_available():
        raise SystemExit("CUDA is not available: W1-W4 need a GPU (use --tiny for a CPU smoke check, or cpu).")

    results: list[dict[str, Any]] = []
    titles: dict[str, str] = {}
    started = time.perf_counter()

    def save() -> None:
        """Write the JSON so far: a command stopped at the device's time limit still leaves what finished."""
        if args.json:
            payload = {
                "environment": {k: environment_of(results).get(k) for k in ENV_KEYS},
                "steps": steps,
                "warmup": warmup,
                "tiny": args.tiny,
                "complete": False,
                "results": results,
                "table": markdown_table(results, titles),
                "w1_reference": W1_REFERENCE,
            }
            payload["complete"] = len({r["workload"] for r in results}) == len(selected)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(args.json, lambda target: target.write_text(json.dumps(payload, indent=2)))

    for name in selected:
        if name == "cpu":
            data = chat_rows(paths.chat_rows(args.rows), args.rows)
            titles["cpu"] = f"({args.rows:,} chat rows)"
            result = runner.child("cpu", "cpu prepare", ["--_data", str(data)])
            results.append(
                result if result.get("ok") else {"workload": "cpu", "variant": "hellbender prepare", **result}
            )
            save()
            continue
        w = workload(name, args.tiny)
        titles[name] = f"({w.title})"
        why = bitsandbytes_usable() if name == "W4" else None
        if why:
            print(f"[W4] skipped: {why}", flush=True)
            results += [{"workload": "W4", "variant": v, "ok": False, "reason": f"skipped: {why}"} for v in variants]
        elif not runner.ensure_model(w):
            results += [{"workload": name, "variant": v, "ok": False, "reason": "model build failed"} for v in variants]
        elif name == "W4":
            for variant in variants:
                results.append(w4_search(runner, w, variant, args.w4_budget_s / len(variants)))
                save()
        else:
            if w.family == "gemma4-vlm":
                data = vlm_rows(paths.vlm_rows(w), w.rows, w.image_px)
            else:
                length = args.documents or w.seq  # `--documents`: rows of that many tokens, packed by hellbender
                rows = steps * w.micro_batch * (w.seq // length)
                data = pretokenized_rows(paths.causal_rows(length, rows), rows, length)
            for variant in variants:
                results.append(runner.train(w, variant, steps, warmup, w.seq, data, timeout=args.child_timeout_s))
                save()
        save()

    env = environment_of(results)
    summary = (
        f"device: {env.get('device', '?')}; torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}"
    )
    summary += f", peft {env.get('peft', '?')}"
    if any(w in ("W1", "W2", "W3") for w in selected):
        summary += f"; {steps} steps, medians over steps {warmup + 1}..{steps}"
        peak = peak_tflops(env.get("device", ""), args.peak_tflops)
        summary += f"; dense bf16 peak for MFU {fmt(peak, '.0f')} TFLOPS"
    print(f"\n{summary}{'; --tiny (toy models)' if args.tiny else ''}\n")
    print(markdown_table(results, titles))
    if "W1" in selected:
        ref = W1_REFERENCE
        print(
            f"\nIssue 7 reference, W1 baseline on one {ref['device']} (torch 2.11 / transformers 5.17 / peft 0.21.0): "
            f"{ref['with_checkpointing']['tokens_per_s']:,} tokens/s at "
            f"{ref['with_checkpointing']['peak_allocated_gib']} GiB peak allocated with checkpointing; "
            f"{ref['without_checkpointing']['tokens_per_s']:,} tokens/s at "
            f"{ref['without_checkpointing']['peak_allocated_gib']} GiB without."
        )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        print(f"wrote {args.json}")
    return 0 if all(r.get("ok") or str(r.get("reason", "")).startswith("skipped") for r in results) else 1


ENV_KEYS = ("device", "gpu_memory_gib", "torch", "transformers", "peft")


def environment_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The environment the children reported (the parent itself never initialises CUDA)."""
    return next((r for r in results if r.get("device")), {})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3", help=f"comma-separated, from {','.join(ALL_WORKLOADS)}")
    p.add_argument("--variants", default="baseline,hellbender", help="which variants to run (default both)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 25; --tiny: 6)")
    p.add_argument(
        "--epoch",
        action="store_true",
        help="train one pass over the rows instead of --steps (W3: e.g. packed against padded rows); the table "
        "gives each run's steps, tokens and wall time over all of them",
    )
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default 5; --tiny: 2)")
    p.add_argument(
        "--profile-steps",
        metavar="A-B",
        help="profile steps A..B of each training run: per step, GPU busy against wall time, and the "
        "top host and device operators (the profiler's own work makes that run's timings incomparable)",
    )
    p.add_argument(
        "--profile-trace",
        type=Path,
        metavar="DIR",
        help="with --profile-steps: also write each run's profiled steps to DIR as a gzipped Chrome trace",
    )
    p.add_argument(
        "--free-running",
        action="store_true",
        help="time the steady steps as one span, synchronising the GPU only at its start and at the run's end (as "
        "a real run goes: the host queues the next step's work while the GPU runs this one); tokens/s is that "
        "span's, with no per-step times, spread or batch wait",
    )
    p.add_argument(
        "--gc",
        choices=("automatic", "frozen"),
        default="automatic",
        help="Python's garbage collection in the training runs: as usual, or frozen and disabled from the first step "
        "(an experiment on the step-time spread)",
    )
    p.add_argument(
        "--documents",
        type=int,
        help="W1/W2: data rows of this many tokens instead of whole rows, for hellbender variants with "
        "`--hb-set sample_packing=true` (several documents per packed row; SDPA against flex attention)",
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"), help="models, data, runs (reused)")
    p.add_argument("--json", type=Path, help="also write every result to this JSON file")
    p.add_argument("--tiny", "--dry-run", action="store_true", help="toy-sized models (CPU without a GPU)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the card, if its name is not known")
    p.add_argument(
        "--hb-set", action="append", default=[], metavar="KEY=VALUE", help="extra hellbender config key (repeatable)"
    )
    p.add_argument(
        "--hb-also",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key for the `hellbender+` variant only, on top of --hb-set (repeatable; add `hellbender+` to "
        "--variants): one lever's gain, measured in the same invocation",
    )
    p.add_argument("--child-timeout-s", type=float, default=900, help="wall-clock cap of one training subprocess")
    p.add_argument("--rows", type=int, default=200_000, help="cpu: synthetic chat rows (default 200000)")
    p.add_argument("--procs", type=int, help="cpu: dataset_num_proc (default: hellbender's, 1)")
    p.add_argument("--tokenizer", help="cpu: a local tokenizer directory instead of the tiny built-in one")
    p.add_argument("--w4-budget-s", type=float, default=480, help="W4: total search time, split between variants")
    p.add_argument("--w4-trial-timeout-s", type=float, default=200, help="W4: cap of one trial subprocess")
    p.add_argument("--w4-start", type=int, default=8192, help="W4: first sequence length (doubled until one fails)")
    p.add_argument("--w4-max-seq", type=int, default=262_144, help="W4: stop doubling beyond this")
    p.add_argument("--w4-precision", type=float, default=0.05, help="W4: stop when the bracket is this fraction")
    p.add_argument("--w4-granularity", type=int, default=256, help="W4: sequence lengths are multiples of this")
    p.add_argument("--w4-steps", type=int, default=1, help="W4: optimizer steps a trial must complete")
    # Internal: how the parent starts a child.
    for hidden in ("--_child", "--_result", "--_workload", "--_variant", "--_data"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--_steps", "--_warmup", "--_seq"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args._child:
        child_main(args)
        return
    sys.exit(parent_main(args))


if __name__ == "__main__":
    main()
