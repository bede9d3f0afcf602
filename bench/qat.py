"""Quantization-aware training on a GPU: what `qat:` costs in training, what `hellbender quantize` gives at inference,
and what QAT buys over post-training quantization (PTQ).

GPU command (one H100 or H200; `.whl/` carried along, torchao among its wheels), about 6 minutes with a fresh 1B
build (bench/throughput.py's W2 model is reused when present under `--workdir`):

    eval "$(bash bench/setup_gpu.sh 2>/dev/null)" && export PYTHONUNBUFFERED=1 &&
    python3 bench/qat.py --json $OUT/qat.json 2>&1 | tee $OUT/qat.log

CPU smoke check (toy models, the CPU schemes `int8` and `int4` + `int8`, a few minutes on two cores):

    python bench/qat.py --tiny --workdir /tmp/SOMEWHERE

Part 1, speed and memory (random weights: no quality signal). bench/throughput.py's W2: the Llama-3.2-1B shape
(tied embeddings, bf16, SDPA), full fine-tuning with AdamW, seq 2048, micro-batch 4, hellbender's activation
checkpointing, `--steps` (8) optimizer steps on the same pre-tokenized rows, trained through hellbender's real path
(`hellbender.train.run.train`) once without `qat:` and once per scheme of `--schemes` with `qat:` (each in its own
subprocess). Measured as throughput.py measures (its step recorder): tokens/s, the median over the steps after
`--warmup` (3), and peak allocated GPU memory from the first step to the last. Then, in a fresh subprocess per run,
`hellbender quantize` of each QAT run (on the CPU, as `quantize` loads the model; its wall time is reported), the
stored size of the weights (`*.safetensors`), the peak allocated GPU memory of loading the model with plain
`from_pretrained(device_map="cuda")`, and forward tokens/s of a prefill-style forward (`logits_to_keep=1`, no
gradients, eager) on the same micro-batch of 4 x 2048 tokens: the bf16 model of the run without QAT against each
quantized model. The median of `--forwards` (8) timed forwards after 2 untimed ones.

Part 2, quality. The tiny Llama (hellbender/tiny-llama, hidden 64) trained on the bundled chat data
(src/hellbender/examples/data/chat.jsonl): its first 336 rows train, its last 64 are held out and never trained on.
Full fine-tuning, `--quality-steps` (60) steps, micro-batch 8, learning rate 3e-3, bf16 on a GPU: once without
`qat:` (then post-training quantized with `quantization:` in each scheme) and once with `qat:` per scheme (then
`hellbender quantize`). The held-out loss is the token-weighted mean cross-entropy over the assistant tokens of the
64 rows (as hellbender prepares them: the same tokens and labels for every model), perplexity its exponential, for
the unquantized trained model and for the stored quantized one. For the QAT runs also the largest and the mean
absolute logit difference between the stored model and the trained model with its layers fake-quantized (what
training saw), beside the "bf16 floor": the same fake-quantized model in float32 against bfloat16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import throughput as tp  # noqa: E402

REPO = HERE.parent
CHAT_DATA = REPO / "src" / "hellbender" / "examples" / "data" / "chat.jsonl"
HELD_OUT_ROWS = 64
SCHEMES: dict[str, dict[str, Any]] = {
    "float8": {"weight_dtype": "float8", "activation_dtype": "float8"},
    "int4+int8": {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32},
    "int8": {"weight_dtype": "int8", "group_size": 32},
}
GPU_SCHEMES, CPU_SCHEMES = "float8,int4+int8", "int8,int4+int8"


# ---------------------------------------------------------------------------------------------------------------
# Children (each a fresh process: no allocator state or peak memory carries over)
# ---------------------------------------------------------------------------------------------------------------


def versions() -> dict[str, Any]:
    from importlib.metadata import version

    return {**tp.environment(), "torchao": version("torchao")}


def train_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One 1B training run through hellbender, timed by throughput.py's step recorder; the final model stays."""
    from hellbender.config import validate_config
    from hellbender.train.run import train

    env = versions()
    recorder = tp.StepRecorder(spec["label"], spec["steps"], spec["warmup"], None, {})
    shutil.rmtree(spec["config"]["output_dir"], ignore_errors=True)
    train(validate_config(spec["config"]), callbacks=[recorder.callback()])
    summary = recorder.summary()
    summary.pop("steps")
    return {"ok": True, **env, **summary}


def serve_child(spec: dict[str, Any]) -> dict[str, Any]:
    """`hellbender quantize` (when the run has a scheme), then the stored model loaded with plain transformers:
    its size, the GPU memory of loading it and forward tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM

    from hellbender.config import validate_config

    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {"ok": True, **versions()}
    model_dir = Path(spec["config"]["output_dir"])
    if spec["quantize"]:
        from hellbender.use.quantize import quantize

        started = time.perf_counter()
        model_dir = quantize(validate_config(spec["config"]), output=model_dir.with_name(model_dir.name + "-quantized"))
        result["quantize_s"] = time.perf_counter() - started
    result["stored_mib"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 2**20
    rows = [json.loads(line)["input_ids"] for line in Path(spec["data"]).read_text().splitlines()[: spec["batch"]]]
    ids = torch.tensor(rows, device="cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", device_map="cuda" if cuda else None).eval()
    result["load_s"] = time.perf_counter() - started
    if cuda:
        torch.cuda.synchronize()
        result["load_peak_gib"] = torch.cuda.max_memory_allocated() / tp.GIB
    seconds = []
    with torch.no_grad():
        for i in range(2 + spec["forwards"]):
            started = time.perf_counter()
            model(ids, logits_to_keep=1)
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:
                seconds.append(time.perf_counter() - started)
    result["forward_tokens_per_s"] = ids.numel() / statistics.median(seconds)
    if cuda:
        result["forward_peak_gib"] = torch.cuda.max_memory_allocated() / tp.GIB
    print(f"[{spec['label']}] {result}", flush=True)
    return result


def held_out_rows(raw: dict[str, Any], held_out: Path) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of the held-out rows, prepared as hellbender prepares training rows."""
    from hellbender.config import validate_config
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer

    cfg = validate_config({**raw, "datasets": [{"path": str(held_out), "type": "chat_template"}], "qat": None})
    prepared = prepare_datasets(cfg, load_tokenizer(cfg)).train
    return [(row["input_ids"], row["labels"]) for row in prepared]


def held_out_loss(model: Any, rows: list[tuple[list[int], list[int]]]) -> tuple[float, Any]:
    """Token-weighted mean cross-entropy over the labelled tokens, and the logits of every row (float32)."""
    import torch
    import torch.nn.functional as F

    total, tokens, logits = 0.0, 0, []
    with torch.no_grad():
        for ids, labels in rows:
            out = model(torch.tensor([ids], device=model.device)).logits.float()[0]
            target = torch.tensor(labels[1:], device=out.device)
            total += F.cross_entropy(out[:-1], target, ignore_index=-100, reduction="sum").item()
            tokens += int((target != -100).sum())
            logits.append(out)
    return total / tokens, torch.cat(logits)


def quality_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The tiny model trained without and with QAT per scheme, each quantized, scored on the held-out rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from hellbender.config import validate_config
    from hellbender.models.qat import prepare_for_qat
    from hellbender.train.run import train
    from hellbender.use.quantize import quantize

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    base = spec["config"]
    rows = held_out_rows(base, Path(spec["held_out"]))

    def load(path: Any, dtype: Any = "auto") -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device).eval()

    def trained(name: str, extra: dict[str, Any]) -> Any:
        raw = {**base, **extra, "output_dir": str(Path(spec["workdir"]) / name)}
        shutil.rmtree(raw["output_dir"], ignore_errors=True)
        cfg = validate_config(raw)
        train(cfg)
        return raw, cfg

    results: list[dict[str, Any]] = []
    plain_raw, plain_cfg = trained("plain", {})
    plain_loss, _ = held_out_loss(load(plain_cfg.output_dir), rows)
    for name in spec["schemes"]:
        scheme = SCHEMES[name]
        ptq = validate_config({**plain_raw, "quantization": scheme})
        stored = quantize(ptq, output=Path(spec["workdir"]) / f"plain-{name}")
        ptq_loss, _ = held_out_loss(load(stored), rows)
        results.append({"scheme": name, "training": "no QAT, then PTQ", "float": plain_loss, "quantized": ptq_loss})
        _, qat_cfg = trained(f"qat-{name}", {"qat": scheme})
        float_loss, _ = held_out_loss(load(qat_cfg.output_dir), rows)
        stored = quantize(qat_cfg, output=Path(spec["workdir"]) / f"qat-{name}-quantized")
        quantized_loss, quantized_logits = held_out_loss(load(stored), rows)
        fake = {}
        for dtype in (torch.bfloat16, torch.float32) if cuda else (torch.float32,):
            model = load(qat_cfg.output_dir).to(dtype)  # the trained weights, upcast exactly for the floor
            prepare_for_qat(model, qat_cfg.qat)
            fake[dtype] = held_out_loss(model, rows)[1]
        trained_as = fake[torch.bfloat16 if cuda else torch.float32]
        difference = (quantized_logits - trained_as).abs()
        row = {"scheme": name, "training": "QAT, then quantize", "float": float_loss, "quantized": quantized_loss}
        row.update(max_vs_fake=difference.max().item(), mean_vs_fake=difference.mean().item())
        if cuda:
            floor = (fake[torch.bfloat16] - fake[torch.float32]).abs()
            row.update(floor_max=floor.max().item(), floor_mean=floor.mean().item())
        results.append(row)
        print(f"[quality] {results[-2]}\n[quality] {row}", flush=True)
    tokens = sum(1 for _, labels in rows for label in labels[1:] if label != -100)
    return {"ok": True, **versions(), "rows": results, "held_out_tokens": tokens}


def child_main(args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore", FutureWarning)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # toy models on a shared CPU: see throughput.py
    spec = json.loads(Path(args._spec).read_text())
    work = {"train": train_child, "serve": serve_child, "quality": quality_child}[args._child]
    Path(args._result).write_text(json.dumps(work(spec), indent=2, default=str))


# ---------------------------------------------------------------------------------------------------------------
# Parent: the runs, one subprocess each, and the tables
# ---------------------------------------------------------------------------------------------------------------


def child(workdir: Path, kind: str, label: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    results = workdir / "results"
    results.mkdir(parents=True, exist_ok=True)
    stem = f"qat-{label.replace(' ', '-').replace('+', '-')}"
    spec_file, result_file = results / f"{stem}.spec.json", results / f"{stem}.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    result_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.setdefault("HF_DATASETS_CACHE", str(workdir / "hf-datasets"))
    env.setdefault("HELLBENDER_CACHE", str(workdir / "hellbender-cache"))
    command = [sys.executable, str(Path(__file__).resolve()), "--_child", kind, "--_spec", str(spec_file)]
    started = time.perf_counter()
    try:
        rc: int | str = subprocess.run([*command, "--_result", str(result_file)], env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc == 0 and result_file.is_file():
        return {**json.loads(result_file.read_text()), "wall_s": time.perf_counter() - started}
    print(f"[{label}] failed: {rc} (its output is above)", flush=True)
    return {"ok": False, "reason": str(rc)}


def speed_runs(args: argparse.Namespace, schemes: list[str], save: Any) -> dict[str, dict[str, Any]]:
    w = tp.workload("W2", args.tiny)
    paths = tp.Paths(args.workdir)
    if not tp.Runner.for_script(args.workdir, args.tiny).ensure_model(w):
        raise SystemExit("building the 1B model failed (the output is above)")
    rows = max(args.steps * w.micro_batch, w.micro_batch)
    data = tp.pretokenized_rows(paths.causal_rows(w.seq, rows), rows, w.seq)
    out: dict[str, dict[str, Any]] = {}
    for name in ["bf16", *schemes]:
        label = f"1B {name}" if name == "bf16" else f"1B QAT {name}"
        job = tp.Job(w, f"qat-bench-{name}", paths, args.steps, w.seq, data, cuda=not args.tiny or args.cuda)
        config = tp.hellbender_raw_config(job, {} if name == "bf16" else {"qat": SCHEMES[name]})
        spec = {"label": label, "steps": args.steps, "warmup": args.warmup, "config": config}
        trained = child(args.workdir, "train", label, spec, args.child_timeout_s)
        served: dict[str, Any] = {}
        if trained.get("ok"):
            serve = {**spec, "quantize": name != "bf16", "data": str(data), "batch": w.micro_batch}
            served = child(args.workdir, "serve", f"{label} serve", {**serve, "forwards": args.forwards}, 600)
        out[name] = {"train": trained, "serve": served}
        save(out)
        shutil.rmtree(job.output_dir, ignore_errors=True)
        shutil.rmtree(job.output_dir.with_name(job.output_dir.name + "-quantized"), ignore_errors=True)
    return out


def quality_run(args: argparse.Namespace, schemes: list[str]) -> dict[str, Any]:
    root = args.workdir / "qat-quality"
    rows = CHAT_DATA.read_text().splitlines()
    train_file, held_out = root / "data" / "train.jsonl", root / "data" / "held_out.jsonl"
    train_file.parent.mkdir(parents=True, exist_ok=True)
    train_file.write_text("\n".join(rows[:-HELD_OUT_ROWS]) + "\n")
    held_out.write_text("\n".join(rows[-HELD_OUT_ROWS:]) + "\n")
    config = {
        "base_model": "hellbender/tiny-llama",
        "datasets": [{"path": str(train_file), "type": "chat_template"}],
        "sequence_len": 256,
        "micro_batch_size": 8,
        "max_steps": args.quality_steps,
        "learning_rate": 3e-3,
        "lr_scheduler": "constant",
        "logging_steps": 10,
        "save_steps": args.quality_steps + 1000,
        "memory_watchdog": "off",
        "bf16": not args.tiny or args.cuda,
        "seed": 0,
        "dataset_prepared_path": str(root / "prepared"),
        "output_dir": str(root / "unused"),
    }
    spec = {"config": config, "held_out": str(held_out), "workdir": str(root / "runs"), "schemes": schemes}
    return child(args.workdir, "quality", "quality", spec, args.child_timeout_s)


def fmt(value: Any, spec: str) -> str:
    return tp.fmt(value, spec)


def speed_table(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| 1B shape, full FT | train tokens/s | train peak alloc GiB | quantize s | stored MiB | load peak GiB | "
        "forward tokens/s | forward vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    bf16 = runs.get("bf16", {}).get("serve", {}).get("forward_tokens_per_s")
    for name, r in runs.items():
        t, s = r["train"], r["serve"]
        title = "no QAT (stored unquantized)" if name == "bf16" else f"QAT {name} (then quantized)"
        if not t.get("ok"):
            lines.append(f"| {title} | failed: {t.get('reason')} | | | | | | |")
            continue
        lines.append(
            f"| {title} | {fmt(t.get('tokens_per_s'), ',.0f')} | {fmt(t.get('peak_allocated_gib'), '.1f')} | "
            f"{fmt(s.get('quantize_s'), '.0f')} | {fmt(s.get('stored_mib'), ',.1f')} | "
            f"{fmt(s.get('load_peak_gib'), '.2f')} | {fmt(s.get('forward_tokens_per_s'), ',.0f')} | "
            f"{tp.ratio(s.get('forward_tokens_per_s'), bf16)} |"
        )
    return "\n".join(lines)


def quality_table(result: dict[str, Any]) -> str:
    lines = [
        "| scheme | training | held-out loss, float | held-out loss, quantized | perplexity, quantized | "
        "Δ loss from quantizing | stored vs fake-quantized max / mean abs logit | bf16 floor max / mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result.get("rows", []):
        vs_fake = f"{r['max_vs_fake']:.4f} / {r['mean_vs_fake']:.5f}" if "max_vs_fake" in r else ""
        floor = f"{r['floor_max']:.4f} / {r['floor_mean']:.5f}" if "floor_max" in r else ""
        lines.append(
            f"| {r['scheme']} | {r['training']} | {r['float']:.4f} | {r['quantized']:.4f} | "
            f"{math.exp(r['quantized']):.3f} | {r['quantized'] - r['float']:+.4f} | {vs_fake} | {floor} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"), help="models, data, runs (models reused)")
    p.add_argument("--schemes", help=f"comma-separated from {', '.join(SCHEMES)} (default {GPU_SCHEMES}; --tiny: "
                   f"{CPU_SCHEMES})")  # fmt: skip
    p.add_argument("--steps", type=int, help="1B training steps per run (default 8; --tiny: 4)")
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default 3; --tiny: 1)")
    p.add_argument("--forwards", type=int, default=8, help="timed forwards per model (after 2 untimed ones)")
    p.add_argument("--quality-steps", type=int, help="training steps of the tiny quality runs (default 60; --tiny: 20)")
    p.add_argument("--parts", default="speed,quality", help="comma-separated from speed,quality")
    p.add_argument("--tiny", action="store_true", help="toy-sized 1B stand-in and CPU schemes (a CPU smoke check)")
    p.add_argument("--cuda", action="store_true", help="with --tiny: still train in bf16 on the GPU")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--child-timeout-s", type=float, default=600, help="wall-clock cap of one subprocess")
    p.add_argument("--_child", choices=["train", "serve", "quality"], help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    return p


def main() -> int:
    args = parser().parse_args()
    if args._child:
        child_main(args)
        return 0
    args.steps = args.steps or (4 if args.tiny else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.quality_steps = args.quality_steps or (20 if args.tiny else 60)
    schemes = [s.strip() for s in (args.schemes or (CPU_SCHEMES if args.tiny else GPU_SCHEMES)).split(",") if s]
    parts = {p.strip() for p in args.parts.split(",")}
    if unknown := set(schemes) - set(SCHEMES):
        raise SystemExit(f"--schemes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SCHEMES)}")
    if not args.tiny and not tp.cuda_available():
        raise SystemExit("CUDA is not available: use --tiny for a CPU smoke check.")
    started = time.perf_counter()
    results: dict[str, Any] = {"schemes": schemes, "steps": args.steps, "quality_steps": args.quality_steps}

    def save(part: str) -> Any:
        def write(value: Any) -> None:  # after every run, so a stopped command leaves what it finished
            results[part] = value
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2, default=str))

        return write

    if "speed" in parts:
        save("speed")(speed_runs(args, schemes, save("speed")))
    if "quality" in parts:
        save("quality")(quality_run(args, schemes))
    reported = [r["train"] for r in results.get("speed", {}).values()] + [results.get("quality", {})]
    env = next((r for r in reported if r.get("device")), {})
    print(
        f"\ndevice: {env.get('device', '?')}; torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}, peft {env.get('peft', '?')}, "
        f"torchao {env.get('torchao', '?')}; schemes {', '.join(schemes)}"
        + ("; --tiny (toy models, CPU schemes)" if args.tiny else "")
    )
    if "speed" in results:
        print(
            f"\nSpeed and memory (random weights; {args.steps} steps, medians over steps "
            f"{args.warmup + 1}..{args.steps}; forward: prefill of the same micro-batch, logits_to_keep=1, eager):\n"
        )
        print(speed_table(results["speed"]))
    if "quality" in results:
        q = results["quality"]
        print(
            f"\nQuality (tiny Llama, {args.quality_steps} steps on the bundled chat data; held-out loss over "
            f"{q.get('held_out_tokens', '?')} assistant tokens of {HELD_OUT_ROWS} rows never trained on):\n"
        )
        print(quality_table(q) if q.get("ok") else f"failed: {q.get('reason')}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    failed = [r for r in reported if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
