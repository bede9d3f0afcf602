"""Memory slope of LoRA training on a Gemma-4-E2B-shaped text model, through hellbender's own `train()`.

Builds `Gemma4ForCausalLM` with Gemma-4-E2B's text dimensions and random weights, saves it (with hellbender's tiny
tokenizer) to a work directory, writes random pre-tokenized rows, and trains it with LoRA and activation
checkpointing for `--steps` steps (default 200) at `--seq` tokens (default 2048), batch 1, bf16. After every step it
records allocated / reserved / peak CUDA memory, then fits a least-squares line to allocated memory from step
`--skip` (default 20) on. PASS means |allocated slope| < 1 MiB/step: no per-step leak (e.g. shared K/V tensors kept
alive by the checkpointed layers' replay functions).

Run on a CUDA machine: `python bench/gemma4_e2b_memory_slope.py [--steps 200] [--seq 2048] [--json out.json]`.
`--tiny` runs a toy-sized model (CPU if there is no GPU; memory is then the process's resident set size) as a
smoke check of the whole path. Results are written up in docs/gemma4.md.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import os
import platform
import random
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

MIB = 1024**2
SEED = 0
SLOPE_LIMIT_MIB = 1.0
FIRST_TOKEN_ID = 10  # the tiny tokenizer's special tokens (pad, eos, ...) are ids 0-3: keep rows free of them


def layer_types(num_layers: int) -> list[str]:
    # Gemma-4-E2B repeats 4 sliding-window layers and 1 full-attention layer.
    return ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)]


# Gemma-4-E2B's text model (config.json of google/gemma-4-E2B). Every key is checked against Gemma4TextConfig of
# transformers 5.24; the GPU machine runs 5.17, so `text_config` passes only the keys the installed version knows.
E2B_TEXT: dict[str, Any] = dict(
    vocab_size=262_144,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    num_kv_shared_layers=20,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262_144,
    sliding_window=512,
    layer_types=layer_types(35),
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)

# Toy size for a CPU smoke check. 10 layers (not 5) with 5 shared, because K/V sharing needs a full-attention layer
# among the layers that still compute their own K/V, and sharing is the path the slope check is about.
TINY_TEXT: dict[str, Any] = {
    **E2B_TEXT,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 10,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_kv_shared_layers": 5,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 1024,
    "layer_types": layer_types(10),
}


def text_config(wanted: dict[str, Any], tokenizer: Any) -> Any:
    """`Gemma4TextConfig` with the keys of `wanted` that the installed transformers knows; prints the others.

    A key counts as known when it is an `__init__` parameter or `__post_init__` reads it from its keyword arguments:
    in 5.24, `global_head_dim` is such a keyword (turned into `per_layer_config`), not a parameter, while unknown
    keys are silently stored as plain attributes, so the signature alone cannot tell."""
    from transformers import Gemma4TextConfig

    params = set(inspect.signature(Gemma4TextConfig.__init__).parameters) - {"self"}
    try:
        post_init_source = inspect.getsource(Gemma4TextConfig.__post_init__)
    except (AttributeError, OSError, TypeError):  # no __post_init__ (older configs) or no source to read
        post_init_source = ""
    known = {k: v for k, v in wanted.items() if k in params or f'"{k}"' in post_init_source}
    dropped = sorted(set(wanted) - set(known))
    if dropped:
        print(f"Gemma4TextConfig of this transformers does not take (dropped): {', '.join(dropped)}")
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return Gemma4TextConfig(**known, **ids)


def attention_shapes(model: Any) -> dict[str, list[int]]:
    """head_dim per layer type, read off the built layers (so a dropped or ignored key shows up here)."""
    shapes: dict[str, set[int]] = {}
    for module in model.modules():
        if type(module).__name__ == "Gemma4TextAttention":
            kind = "sliding" if getattr(module, "is_sliding", False) else "full"
            shapes.setdefault(kind, set()).add(module.head_dim)
    return {kind: sorted(dims) for kind, dims in shapes.items()}


def build_model_dir(model_dir: Path, config_keys: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict:
    """Save a random-weight Gemma4ForCausalLM and the tiny tokenizer to `model_dir`; returns facts about it."""
    from transformers import Gemma4ForCausalLM

    from hellbender.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = text_config(config_keys, tokenizer)
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    # Built on the target device in the target dtype: E2B is ~4.6B parameters (2.3B of them per-layer embeddings),
    # too slow to initialise on CPU and twice the size in fp32.
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Gemma4ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    facts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "head_dims": attention_shapes(model),
        "kv_shared_layers": config.num_kv_shared_layers,
    }
    expected = {"sliding": [config_keys["head_dim"]], "full": [config_keys["global_head_dim"]]}
    if facts["head_dims"] != expected:  # e.g. `global_head_dim` dropped or ignored by this transformers
        print(f"WARNING: head_dim per layer type is {facts['head_dims']}, not {expected}: not the intended shape.")
    # transformers 5 always writes safetensors (the `safe_serialization` argument is gone).
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    return facts


def write_rows(path: Path, rows: int, seq: int, vocab: int) -> None:
    # hellbender's `pretokenized` format rejects ids outside the tokenizer (the tiny one has 512 tokens), so ids
    # stay below its size; which ids are used does not change memory with frozen embeddings.
    rng = random.Random(SEED)
    with path.open("w") as f:
        for _ in range(rows):
            ids = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(seq)]
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")


def current_rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # only the peak is available without psutil
        return peak_rss()


def peak_rss() -> int:
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


@dataclass
class Sample:
    step: int
    allocated: int  # CUDA memory allocated, or process RSS on CPU
    reserved: int | None  # CUDA only
    peak: int  # CUDA max allocated, or peak RSS on CPU
    seconds: float
    side_channel_entries: int | None


@dataclass
class Recorder:
    """Builds the `TrainerCallback` that samples memory after every optimizer step (on CUDA after a synchronize,
    so the step time covers the GPU work)."""

    cuda: bool
    samples: list[Sample] = field(default_factory=list)
    attn_implementation: str | None = None
    checkpoint_side_channel: bool = False

    def callback(self) -> Any:
        from transformers import TrainerCallback

        from hellbender.models.activation_checkpointing import side_channel_of

        recorder = self

        class MemoryRecorder(TrainerCallback):
            started = 0.0

            def on_train_begin(self, args, state, control, model=None, **kwargs):
                base = model.get_base_model() if hasattr(model, "get_base_model") else model
                recorder.attn_implementation = getattr(base.config, "_attn_implementation", None)
                recorder.checkpoint_side_channel = side_channel_of(model) is not None
                if recorder.cuda:
                    torch.cuda.reset_peak_memory_stats()

            def on_step_begin(self, args, state, control, **kwargs):
                self.started = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kwargs):
                channel = side_channel_of(model)
                if recorder.cuda:
                    torch.cuda.synchronize()
                    memory = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
                    peak = torch.cuda.max_memory_allocated()
                else:
                    rss = current_rss()
                    memory, peak = (rss, None), max(rss, peak_rss())  # the two are read at different moments
                recorder.samples.append(
                    Sample(
                        state.global_step,
                        *memory,
                        peak,
                        time.perf_counter() - self.started,
                        None if channel is None else len(channel),
                    )
                )

        return MemoryRecorder()


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0


def hellbender_config(run_dir: Path, model_dir: Path, data: Path, steps: int, seq: int, bf16: bool) -> Any:
    from hellbender.config import validate_config

    return validate_config(
        {
            "base_model": str(model_dir),
            "datasets": [{"path": str(data), "type": "pretokenized", "ds_type": "jsonl"}],
            "sequence_len": seq,
            "excess_length_strategy": "raise",  # every row is exactly `seq` tokens; none may vanish silently
            "sample_packing": False,
            "adapter": "lora",  # default targets: q/k/v/o and gate/up/down projections
            "lora_r": 16,
            "lora_alpha": 32,
            "gradient_checkpointing": True,
            "bf16": bf16,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "max_steps": steps,
            "learning_rate": 1e-4,
            "save_steps": steps + 1000,  # no checkpoint during the run
            "logging_steps": 10,
            "memory_watchdog": "warn",
            "seed": SEED,
            "output_dir": str(run_dir / "out"),
            "dataset_prepared_path": str(run_dir / "prepared"),
        }
    )


def summarise(recorder: Recorder, skip: int) -> dict[str, Any]:
    fitted = [s for s in recorder.samples if s.step >= skip] or recorder.samples
    steps = [float(s.step) for s in fitted]
    allocated_slope = slope(steps, [s.allocated / MIB for s in fitted])
    reserved = [s.reserved for s in fitted]
    reserved_slope = slope(steps, [r / MIB for r in reserved]) if None not in reserved else None
    return {
        "fitted_steps": [int(steps[0]), int(steps[-1])],
        "allocated_slope_mib_per_step": allocated_slope,
        "reserved_slope_mib_per_step": reserved_slope,
        "allocated_first_mib": fitted[0].allocated / MIB,
        "allocated_last_mib": fitted[-1].allocated / MIB,
        "peak_mib": max(s.peak for s in recorder.samples) / MIB,
        "median_step_ms": statistics.median(s.seconds for s in fitted) * 1000,
        "max_side_channel_entries": max((s.side_channel_entries or 0) for s in recorder.samples),
        "result": "PASS" if abs(allocated_slope) < SLOPE_LIMIT_MIB else "FAIL",
    }


def markdown_table(env: dict[str, Any], summary: dict[str, Any], cuda: bool) -> str:
    memory = "CUDA allocated" if cuda else "process RSS"

    def num(value: float | None, spec: str = ".2f") -> str:
        return "n/a" if value is None else format(value, spec)

    rows = [
        ("device", env["device"]),
        ("torch / transformers", f"{env['torch']} / {env['transformers']}"),
        ("model", f"{env['model']}, {env['parameters'] / 1e6:,.1f}M parameters"),
        ("head_dim per layer type", ", ".join(f"{kind} {dims}" for kind, dims in env["head_dims"].items())),
        ("K/V-shared layers", str(env["kv_shared_layers"])),
        ("attention / checkpoint side channel", f"{env['attn_implementation']} / {env['checkpoint_side_channel']}"),
        ("seq x steps", f"{env['seq']} x {env['steps']}"),
        ("fitted steps", "{}..{}".format(*summary["fitted_steps"])),
        (f"{memory} slope (MiB/step)", num(summary["allocated_slope_mib_per_step"], ".3f")),
        ("CUDA reserved slope (MiB/step)", num(summary["reserved_slope_mib_per_step"], ".3f")),
        (
            f"{memory} first -> last (MiB)",
            f"{summary['allocated_first_mib']:.0f} -> {summary['allocated_last_mib']:.0f}",
        ),
        ("peak (MiB)", num(summary["peak_mib"], ".0f")),
        ("median step (ms)", num(summary["median_step_ms"], ".1f")),
        ("max side-channel entries at step end", str(summary["max_side_channel_entries"])),
        (f"result (slope within +-{SLOPE_LIMIT_MIB:g} MiB/step)", summary["result"]),  # no "|" in a table cell
    ]
    return "\n".join(["| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="optimizer steps (default 200; --tiny: 12)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 2048; --tiny: 64)")
    parser.add_argument("--skip", type=int, help="first step of the fitted line (default 20; --tiny: 3)")
    parser.add_argument("--workdir", type=Path, help="where the run directory is made (default: system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (saved model, data, output)")
    parser.add_argument("--tiny", action="store_true", help="toy-sized model, CPU if no GPU: a smoke check")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args()
    steps = args.steps or (12 if args.tiny else 200)
    seq = args.seq or (64 if args.tiny else 2048)
    skip = args.skip if args.skip is not None else (3 if args.tiny else 20)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit(
            "CUDA is not available: the E2B-sized run needs a CUDA GPU (use --tiny for a CPU smoke check)."
        )
    # Everything is local: never wait on the hub from a machine without network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import transformers

    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    # A fresh directory of our own, so deleting it at the end never touches anything else in --workdir.
    run_dir = Path(tempfile.mkdtemp(prefix="gemma4-e2b-slope-", dir=args.workdir))
    print(f"run directory: {run_dir}")
    try:
        device = torch.device("cuda" if cuda else "cpu")
        started = time.perf_counter()
        facts = build_model_dir(
            run_dir / "model", TINY_TEXT if args.tiny else E2B_TEXT, device, torch.bfloat16 if cuda else torch.float32
        )
        if cuda:  # the training run starts from an empty GPU
            gc.collect()
            torch.cuda.empty_cache()
        print(f"built and saved the model in {time.perf_counter() - started:.0f} s: {facts}")

        from hellbender.models.tiny import build_tiny_tokenizer
        from hellbender.train.run import train

        data = run_dir / "train.jsonl"
        write_rows(data, steps, seq, len(build_tiny_tokenizer()))
        cfg = hellbender_config(run_dir, run_dir / "model", data, steps, seq, bf16=cuda)
        recorder = Recorder(cuda)
        started = time.perf_counter()
        train(cfg, callbacks=[recorder.callback()])
        print(f"trained {steps} steps in {time.perf_counter() - started:.0f} s")
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)

    env = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": "tiny Gemma 4" if args.tiny else "Gemma-4-E2B text (random weights)",
        **facts,
        "attn_implementation": recorder.attn_implementation,
        "checkpoint_side_channel": recorder.checkpoint_side_channel,
        "seq": seq,
        "steps": steps,
    }
    summary = summarise(recorder, skip)
    print()
    print(markdown_table(env, summary, cuda))
    if args.json:
        payload = {**env, **summary, "samples": [asdict(s) for s in recorder.samples]}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
