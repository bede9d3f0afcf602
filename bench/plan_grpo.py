"""`hellbender plan`'s predictions for online RL (`rl: grpo`) against what GRPO runs measured: the step time, the
generation's share of it, and the peak allocated memory, for W6 (bench/grpo_throughput.py: the Llama-3.2-1B shape,
LoRA r16 on every linear layer, every completion exactly `--completion-len` tokens) at several settings.

Without a GPU it predicts the runs recorded below (docs/benchmarks.md and docs/plan.md, one H200) from the same
configs on the meta device (the model's config.json only):

    python3 bench/plan_grpo.py [--gpu H200]

On a CUDA machine `--measure CASE[,CASE]` runs those cases first (each one `bench/grpo_throughput.py --sides
hellbender` invocation in its own process, `sequence_len` set to prompt + completion as the planner reads it) and
compares with what they measured. A case's key `trl.compile_generation: false` decodes eagerly.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import grpo_throughput as w6  # noqa: E402  (beside this script)
import throughput  # noqa: E402  (the 1B shape)


@dataclass(frozen=True)
class Case:
    prompts: int
    generations: int
    micro_batch: int
    prompt_len: int
    completion_len: int
    keys: dict[str, Any] = field(default_factory=dict)
    # (seconds per step, generation seconds per step, peak allocated GiB) measured on one H200, where recorded
    recorded: tuple[float, float, float] | None = None


CASES: dict[str, Case] = {
    # docs/benchmarks.md, "Online RL, W6" (2026-11-27): hellbender's defaults, and eager decoding
    "W6": Case(8, 8, 8, 256, 256, recorded=(4.73, 2.80, 4.1)),
    "W6-eager": Case(8, 8, 8, 256, 256, {"trl.compile_generation": False}, recorded=(9.52, 7.91, 4.9)),
    # settings the constants were not fitted to, measured with `--measure` (one H200, 2026-11-28; 5 steps, medians
    # of steps 3-5)
    "long-completions": Case(4, 8, 8, 128, 512, recorded=(4.58, 3.78, 3.74)),
    "mb4-short": Case(8, 4, 4, 384, 128, recorded=(2.58, 1.15, 3.26)),
}


def config_for(name: str, case: Case, model_dir: Path, workdir: Path) -> Any:
    from hellbender.config import validate_config

    data = workdir / "prompts.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    job = w6.Job("hellbender", model_dir, data, workdir, case.prompts, case.generations, case.micro_batch,
                 case.completion_len, 1.0, 8, True)  # fmt: skip
    keys = {"sequence_len": case.prompt_len + case.completion_len, **case.keys}
    return validate_config(w6.hellbender_raw_config(job, keys))


def measure(name: str, case: Case, workdir: Path) -> tuple[float, float, float]:
    out = workdir / f"{name}.json"
    sets = [f"--hb-set=sequence_len={case.prompt_len + case.completion_len}"]
    sets += [f"--hb-set={key}={str(value).lower()}" for key, value in case.keys.items()]
    command = [sys.executable, str(BENCH / "grpo_throughput.py"), "--sides", "hellbender", "--json", str(out),
               "--prompts", str(case.prompts), "--generations", str(case.generations), "--micro-batch",
               str(case.micro_batch), "--prompt-len", str(case.prompt_len), "--completion-len",
               str(case.completion_len), "--steps", "5", "--warmup", "2", "--workdir", str(workdir / "w6"), *sets]  # fmt: skip
    subprocess.run(command, check=False)
    result = json.loads(out.read_text())["results"]["hellbender"]
    return result["step_s"], result["generate_s"], result["peak_allocated_gib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H200", help="the card to plan for (the recorded runs': H200)")
    parser.add_argument("--measure", default="", help="cases to run on this machine's GPU first (comma-separated)")
    args = parser.parse_args()

    from transformers import LlamaConfig

    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.plan.budget import plan_for
    from hellbender.plan.memory import GIB

    workdir = Path(tempfile.mkdtemp(prefix="plan-grpo-"))
    model_dir = workdir / "model"
    LlamaConfig(**throughput.LLAMA32_1B).save_pretrained(model_dir)  # the shape, no weights
    build_tiny_tokenizer().save_pretrained(model_dir)
    measured = {}
    for name in filter(None, args.measure.split(",")):
        measured[name] = measure(name, CASES[name], workdir)
        print(f"[measured] {name}: {measured[name]}", flush=True)
    print(f"\nPredicted on {args.gpu} against measured (step and generation seconds per optimizer step, peak GiB):\n")
    print("| case | completions x (prompt + completion) | step s, predicted / measured | generation s | peak GiB | "
          "peak at |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, case in CASES.items():
        plan = plan_for(config_for(name, case, model_dir, workdir), gpu=args.gpu)
        rollout = plan.time.rollout
        assert rollout is not None
        got = measured.get(name) or case.recorded
        predicted = (plan.time.seconds, rollout.seconds, plan.memory.peak / GIB)
        cells = [
            f"{p:.2f} / {m:.2f} ({p / m:.2f})" if m else f"{p:.2f} / -"
            for p, m in zip(predicted, got or (0, 0, 0), strict=True)
        ]
        shape = f"{case.prompts * case.generations} x ({case.prompt_len} + {case.completion_len})"
        print(f"| {name}{'' if name in measured else ' (recorded)' if got else ''} | {shape} | {' | '.join(cells)} | "
              f"{plan.memory.peak_phase} |")  # fmt: skip


if __name__ == "__main__":
    main()
