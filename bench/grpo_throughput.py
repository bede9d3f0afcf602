"""W6: online RL (GRPO) step time and memory, plain TRL GRPOTrainer + PEFT against hellbender, on the same model,
prompts, reward function and settings.

GPU command (one H100; `.whl/` carried along, e.g. the run tool's `carry: [".whl"]`), both sides in one invocation,
estimated (not yet measured) at about 4 minutes with a fresh 1B build and the wheel install, under 6:

    bash bench/setup_gpu.sh > /tmp/pythonpath && . /tmp/pythonpath && export PYTHONUNBUFFERED=1 &&
    python3 bench/grpo_throughput.py --json $OUT/w6.json 2>&1 | tee $OUT/w6.log

CPU smoke check (toy model: hidden 64, 2 layers; prompts of 64 tokens, completions of 32, 6 steps; about a minute
on two cores):

    python bench/grpo_throughput.py --shape tiny --device cpu --workdir /tmp/SOMEWHERE

Workload (`--shape llama3.2-1b`, the default): the Llama-3.2-1B shape of bench/throughput.py (random weights, bf16,
SDPA; the same saved directory as its W2, so a machine that ran W2 reuses the build), LoRA r16 alpha 32 on every
linear layer of the decoder, GRPO with TRL's defaults (`beta` 0: no reference model, loss `dapo`, rewards scaled
within the group, one optimisation pass per generation), `--prompts` (8) prompts per optimizer step x
`--generations` (8) completions each, micro-batch `--micro-batch` (8) completions, so gradient accumulation is
prompts x generations / micro-batch (8) and one optimizer step trains on 64 completions, all generated in one
`generate` call at its start (TRL's `steps_per_generation` = gradient accumulation). Each prompt is a chat message of
exactly `--prompt-len` (256) tokens as the chat template renders it for generation; each completion is exactly
`--completion-len` (256) tokens, sampled at temperature `--temperature` (1.0). The reward is the share of even token
ids in the completion (`even_tokens` of hellbender's tiny GRPO example: both sides call the same function). `--steps`
(8) optimizer steps at a constant learning rate of 1e-5, the first `--warmup` (2) left out of the medians.

The two sides, each in its own subprocess (no allocator state carries over; the parent never touches the GPU):
  baseline    what TRL's documentation shows: `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`, the prompts as a
              conversational `datasets` JSON dataset, `GRPOTrainer(model, reward_funcs=[even_tokens],
              args=GRPOConfig(...), train_dataset, processing_class=tokenizer, peft_config=LoraConfig(r=16,
              lora_alpha=32, target_modules="all-linear"))`, generation with transformers' `generate` (no vLLM).
              GRPOConfig keeps TRL's defaults (its gradient checkpointing is on by default) except the batch, the
              generation lengths and temperature, steps, learning rate and schedule.
  hellbender  the same as a config (`rl: grpo`, the `trl:` block, the prompts file as it is) trained by
              `hellbender.train.run.train`, on hellbender's defaults: its activation checkpointing and, on a GPU,
              generation with a static key-value cache and a compiled decoding step (`trl.compile_generation`).
              `--hb-set KEY=VALUE` adds or replaces keys (e.g. `trl.compile_generation=false`, `liger_rope=true`).
              Every key that differs from the baseline is printed.

The same work on both sides. Sampling decides how long a completion is; so that both sides generate and train the
same number of tokens, each side's model gets, in its child process only, a wrapper around its `generate` (the method
TRL calls) that adds `min_new_tokens` = `--completion-len`: transformers then masks every end-of-sequence id TRL passes
until the last token, so every completion is cut at exactly `max_completion_length` on both sides. The result asserts
it: every generated batch must have that many new tokens, and TRL's logged `completions/mean_length` must equal it at
every step (the table's `completion len` column says `ok`; a mismatch fails the run). The report also compares what each side's trainer
was configured with (TRL's batch fields, `beta`, the loss, the sampling settings of the generation config) and prints
any difference. Both sides start from the same LoRA weights (bench/preference_throughput.py's `same_adapter_start`)
and seed; their rewards and gradient norms per step are printed side by side (with float32 on CPU, in the smoke
check, they agree to every printed digit: both sides sampled the same completions).

Measurements (bench/throughput.py's step recorder):
- step time: wall time between consecutive `on_step_end` calls, after `torch.cuda.synchronize()`: generation,
  reward, the forward and backward of the 8 micro-batches and the optimizer step. Medians over steps
  `--warmup`+1..`--steps`. completions/s = completions per step / step time; tokens/s = the prompt and completion
  tokens of the step's completions (64 x (256 + 256)) / step time.
- generation: time inside the model's `generate` (the wrapper above, synchronised before and after); training is the
  rest of the step (scoring, the policy's forward and backward, the optimizer).
- peak memory: `max_memory_allocated` / `max_memory_reserved` from the start of training (the model on the GPU) to its
  end. setup: seconds from the script's start to the first step (imports, model load, data preparation).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # shapes, model building, the child launcher and the step recorder are shared
    sys.path.insert(0, str(HERE))

import preference_throughput as pt  # noqa: E402
import throughput as tp  # noqa: E402

SIDES = ("baseline", "hellbender")
SHAPES = {"llama3.2-1b": False, "tiny": True}  # name -> bench/throughput.py's `tiny` flag
LEARNING_RATE = 1e-5
REWARD_MODULE, REWARD_FUNCTION = "tiny_grpo_rewards", "even_tokens"  # in hellbender's examples directory
# TRL's batch and loss fields each side's trainer must agree on (read from its GRPOConfig at the start of training).
TRAINER_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "num_iterations",
    "max_completion_length",
    "beta",
    "loss_type",
    "scale_rewards",
    "temperature",
    "top_p",
    "top_k",
    "learning_rate",
    "lr_scheduler_type",
    "optim",
    "bf16",
    "seed",
)
# What is sampled, compared between the sides. The key-value cache and compilation (`trl.compile_generation`) are how
# the same distribution is sampled, so they are reported as settings, not compared.
GENERATION_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
                     "eos_token_id", "pad_token_id")  # fmt: skip


def rewards_dir() -> Path:
    """hellbender's examples directory, where the reward function's file lies (found without importing hellbender)."""
    spec = importlib.util.find_spec("hellbender")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("hellbender is not importable: put src/ on PYTHONPATH (bench/setup_gpu.sh prints it)")
    return Path(next(iter(spec.submodule_search_locations))) / "examples"


def reward_function() -> Any:
    """The reward function both sides call, loaded from its file as hellbender loads `trl.reward_funcs`."""
    path = rewards_dir() / f"{REWARD_MODULE}.py"
    spec = importlib.util.spec_from_file_location(REWARD_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, REWARD_FUNCTION)


# ---------------------------------------------------------------------------------------------------------------
# Data: chat prompts of an exact token length (written by the parent, read by both sides)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSpec:
    prompt_len: int
    rows: int

    @property
    def name(self) -> str:
        return f"grpo-prompts-p{self.prompt_len}-rows{self.rows}"


def write_prompts(path: Path, spec: PromptSpec, tokenizer: Any) -> dict[str, Any]:
    """`spec.rows` conversational prompt rows (`{"prompt": [user message]}`), each `spec.prompt_len` tokens as the
    chat template renders it with the generation prompt; returns the measured counts."""
    rng = random.Random(tp.SEED)
    fillers = pt.one_token_words(tokenizer)
    if not fillers:
        raise SystemExit("the tokenizer has no one-token word among the benchmark's words: cannot fit exact lengths")

    def prompt_tokens(text: str) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)  # fmt: skip
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def words_only(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    markup = prompt_tokens("Why") - words_only("Why")
    rows, counts = [], []
    for _ in range(spec.rows):
        text = pt.fitted_text(lambda t: markup + words_only(t), prompt_tokens, spec.prompt_len, rng, fillers, "Why")
        rows.append({"prompt": [{"role": "user", "content": text}]})
        counts.append(prompt_tokens(text))
    tp.write_atomically(path, lambda target: target.write_text("".join(json.dumps(r) + "\n" for r in rows)))
    stats = {"prompt": pt.summary(counts)}
    path.with_suffix(".tokens.json").write_text(json.dumps(stats))
    return stats


# ---------------------------------------------------------------------------------------------------------------
# Shared by both sides: the recorder, with the generation wrapper and TRL's logged metrics per step
# ---------------------------------------------------------------------------------------------------------------


class GrpoRecorder(tp.StepRecorder):
    """bench/throughput.py's step recorder. Tokens are counted where they are generated (each completion with its
    prompt), the time inside `generate` is summed per step, and TRL's logged reward and completion lengths are kept
    per step. The generation wrapper also fixes every completion's length (`min_new_tokens`)."""

    def __init__(self, label: str, total_steps: int, warmup: int, completion_len: int):
        super().__init__(label, total_steps, warmup, None, {})
        self.completion_len = completion_len
        self.logged: dict[str, dict[int, float]] = {
            "reward": {},
            "grad_norm": {},
            "mean_length": {},
            "clipped_ratio": {},
        }
        self.generations: list[dict[str, Any]] = []
        self.generate_s = 0.0
        self.trainer_fields: dict[str, Any] = {}
        self.generation_fields: dict[str, Any] = {}
        self.setup_s: float | None = None
        self.generation_peak = 0  # bytes: the highest peak allocated memory a `generate` call set (0: none did)

    def _peak_allocated(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def _count_rows(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """Rows are counted by `generate` instead: the policy's training forward may run through a fused loss that
        bypasses the model's own call."""

    def watch_generation(self, model: Any) -> None:
        """Wrap `model.generate` (an attribute of this instance only): every completion gets exactly
        `completion_len` tokens, and the time, prompt and completion tokens of each call are recorded."""
        import torch

        original = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            kwargs["min_new_tokens"] = self.completion_len
            config = kwargs.get("generation_config")
            if config is not None and not self.generation_fields:
                self.generation_fields = {k: _plain(getattr(config, k, None)) for k in GENERATION_FIELDS}
            started = self._sync()
            peak_before = self._peak_allocated()
            output = original(*args, **kwargs)
            seconds = self._sync() - started
            # Whether generation raised the run's peak, and to what: where the memory goes.
            self.generation_peak = max(
                self.generation_peak, self._peak_allocated() if self._peak_allocated() > peak_before else 0
            )
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            sequences = output if hasattr(output, "shape") else output.sequences
            width = int(ids.shape[1])
            prompts = [int(n) for n in mask.sum(dim=1).tolist()] if mask is not None else [width] * int(ids.shape[0])
            new = int(sequences.shape[1]) - width
            # the recorder's rows are (lengths, image tokens) tensors per batch (throughput.py's `_read_rows`)
            lengths = torch.tensor([p + new for p in prompts])
            self.rows.append((lengths, lengths * 0))
            self.generate_s += seconds
            self.generations.append(
                {
                    "sequences": len(prompts),
                    "prompt_min": min(prompts),
                    "prompt_max": max(prompts),
                    "prompt_width": width,
                    "new_tokens": new,
                    "seconds": seconds,
                }  # fmt: skip
            )
            return output

        model.generate = generate

    def on_train_begin_with(self, args: Any, model: Any) -> None:
        self.features.update(pt.same_adapter_start(model))
        self.trainer_fields = {k: _plain(getattr(args, k, None)) for k in TRAINER_FIELDS}
        self.watch_generation(model)
        self.setup_s = time.perf_counter() - pt.STARTED
        super().on_train_begin(args, model)

    def on_step_end(self, step: int) -> None:
        super().on_step_end(step)
        self.steps[-1]["generate_s"], self.generate_s = self.generate_s, 0.0

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self
        logged = {"reward": "reward", "grad_norm": "grad_norm", "completions/mean_length": "mean_length",
                  "completions/clipped_ratio": "clipped_ratio"}  # fmt: skip

        class Recorder(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                recorder.on_train_begin_with(args, model)

            def on_step_begin(self, args, state, control, **kwargs):
                recorder.on_step_begin(state.global_step + 1)

            def on_step_end(self, args, state, control, **kwargs):
                recorder.on_step_end(state.global_step)

            def on_log(self, args, state, control, logs=None, **kwargs):
                for key, name in logged.items():
                    if logs and key in logs:
                        recorder.logged[name][state.global_step] = float(logs[key])

            def on_train_end(self, args, state, control, **kwargs):
                recorder.on_train_end()

        return Recorder()

    def result(self, completions_per_step: int) -> dict[str, Any]:
        out = self.summary()
        steady = [s for s in self.steps if s["step"] > self.warmup] or self.steps
        if steady:
            out["completions_per_s"] = statistics.median(completions_per_step / s["seconds"] for s in steady)
            out["generate_s"] = statistics.median(s["generate_s"] for s in steady)
            out["train_s"] = statistics.median(s["seconds"] - s["generate_s"] for s in steady)
        lengths = self.logged["mean_length"]
        new_tokens = {g["new_tokens"] for g in self.generations}
        out.update(
            completions_per_step=completions_per_step,
            logged={name: {str(k): v for k, v in sorted(values.items())} for name, values in self.logged.items()},
            generations=self.generations,
            trainer_fields=self.trainer_fields,
            generation_fields=self.generation_fields,
            setup_s=self.setup_s,
            generation_peak_gib=self.generation_peak / 2**30,
            # The same work on both sides: every completion exactly `completion_len` tokens, by both counts.
            completion_length_ok=bool(self.generations)
            and new_tokens == {self.completion_len}
            and len(lengths) == len(self.steps)
            and all(v == self.completion_len for v in lengths.values()),
        )
        return out


def _plain(value: Any) -> Any:
    """A JSON-ready form of a config field (enums by value)."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (int, float, str, bool, list, type(None))) else str(value)


# ---------------------------------------------------------------------------------------------------------------
# The two sides (each in a child process)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    side: str
    model_dir: Path
    data: Path
    workdir: Path
    prompts: int  # per optimizer step
    generations: int
    micro_batch: int  # completions
    completion_len: int
    temperature: float
    steps: int
    cuda: bool

    @property
    def completions(self) -> int:
        return self.prompts * self.generations

    @property
    def grad_accum(self) -> int:
        return self.completions // self.micro_batch

    @property
    def output_dir(self) -> Path:
        return self.workdir / "runs" / f"W6-{self.side}"

    @property
    def optimizer(self) -> str:
        return "adamw_torch_fused" if self.cuda else "adamw_torch"


def train_baseline(job: Job, recorder: GrpoRecorder) -> None:
    """Plain TRL + PEFT, as TRL's documentation writes a LoRA GRPO run."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, model, dataset = pt.baseline_model_and_rows(job)
    args = GRPOConfig(
        output_dir=str(job.output_dir),
        per_device_train_batch_size=job.micro_batch,  # completions
        gradient_accumulation_steps=job.grad_accum,
        num_generations=job.generations,
        max_completion_length=job.completion_len,
        temperature=job.temperature,
        max_steps=job.steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=job.cuda,
        optim=job.optimizer,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=tp.SEED,
    )
    recorder.features.update(
        checkpointing=f"transformers' (TRL's default gradient_checkpointing={args.gradient_checkpointing}, "
        f"gradient_checkpointing_kwargs={args.gradient_checkpointing_kwargs})",
    )
    peft_config = LoraConfig(
        r=pt.LORA_R, lora_alpha=pt.LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward_function()],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[recorder.callback()],
    )
    trainer.train()


# hellbender's defaults: on a GPU they decode with a static cache and a compiled step (`trl.compile_generation`), which
# Liger's rotary kernel would break at every layer; Liger's other kernels cost more decoding time than they save in
# training here (bench/README.md).
GRPO_SPEED_RECIPE: dict[str, Any] = {}


def hellbender_raw_config(job: Job, overrides: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "base_model": str(job.model_dir),
        "rl": "grpo",
        "trl": {
            "reward_funcs": [f"{REWARD_MODULE}.{REWARD_FUNCTION}"],
            "reward_funcs_dir": str(rewards_dir()),
            "num_generations": job.generations,
            "max_completion_length": job.completion_len,
            "temperature": job.temperature,
        },
        "datasets": [{"path": str(job.data)}],
        **pt.run_keys(job, LEARNING_RATE, GRPO_SPEED_RECIPE),
    }
    for key, value in overrides.items():  # `trl.KEY=VALUE` reaches into the block
        if key.startswith("trl."):
            raw["trl"][key.removeprefix("trl.")] = value
        else:
            raw[key] = value
    return raw


def train_hellbender(job: Job, recorder: GrpoRecorder, overrides: dict[str, Any]) -> None:
    from hellbender.config import validate_config
    from hellbender.train.run import train

    cfg = validate_config(hellbender_raw_config(job, overrides))
    mode = cfg.gradient_checkpointing
    recorder.features["checkpointing"] = f"hellbender ({'offload' if mode == 'offload' else 'on' if mode else 'off'})"
    pt.record_kernels(cfg, recorder.features)
    train(cfg, callbacks=[recorder.callback()])


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    job = Job(args._side, Path(args._model), Path(args._data), args.workdir, args.prompts, args.generations,
              args.micro_batch, args.completion_len, args.temperature, args.steps, cuda)  # fmt: skip
    recorder = GrpoRecorder(f"W6 {job.side}", job.steps, args.warmup, job.completion_len)
    sides = {"baseline": train_baseline, "hellbender": train_hellbender}
    return pt.timed_side(job, recorder, sides, args.hb_set, job.completions)


# ---------------------------------------------------------------------------------------------------------------
# Parent: model, prompts, the two children, the tables
# ---------------------------------------------------------------------------------------------------------------


def forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--shape", args.shape, "--device", args.device, "--workdir", str(args.workdir)]
    out += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts)]
    out += ["--generations", str(args.generations), "--micro-batch", str(args.micro_batch)]
    out += ["--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)]
    out += ["--temperature", str(args.temperature)]
    for item in args.hb_set:
        out += ["--hb-set", item]
    return out


def child(args: argparse.Namespace, kind: str, extra: list[str], label: str) -> dict[str, Any]:
    return pt.child(args, kind, extra, label, script=Path(__file__), forward=forwarded, prefix="W6")


def ensure_model(args: argparse.Namespace) -> Path:
    """bench/throughput.py's W2 model (the Llama-3.2-1B shape), built once by a child and reused."""
    tiny = SHAPES[args.shape]
    w = tp.workload("W2", tiny)
    target = args.workdir / "models" / w.model_key
    if tp.model_is_built(target, tp.model_spec(w, tiny)):
        print(f"[build {w.model_key}] reusing {target}", flush=True)
        return target
    if not child(args, "build", [], f"build-{w.model_key}").get("ok"):
        raise SystemExit("building the model failed (its output is above)")
    return target


def differing_settings(args: argparse.Namespace, cuda: bool) -> list[str]:
    """What the hellbender side sets beyond the baseline's settings, for the report."""
    overrides = tp.parse_overrides(args.hb_set)
    raw = hellbender_raw_config(Job("hellbender", Path("model"), Path("data"), args.workdir, 1, 2, 2, 1, 1.0, 1, cuda),
                                overrides)  # fmt: skip
    baseline = {"gradient_checkpointing": True}  # TRL's default; any other key the baseline lacks is off
    lines = []
    for key in dict.fromkeys([*(GRPO_SPEED_RECIPE if cuda else {}), *overrides]):
        # Every `trl.` key given replaces a value both sides had.
        value = raw["trl"].get(key.removeprefix("trl.")) if key.startswith("trl.") else raw.get(key)
        if key.startswith("trl.") or value != baseline.get(key, False):
            lines.append(f"{key}: {value}")
    lines.append("activation checkpointing: hellbender's (non-reentrant, per layer) instead of transformers'")
    if cuda and raw["trl"].get("compile_generation") is not False:
        lines.append(
            "generation: static key-value cache and compiled decoding (`trl.compile_generation`, on by default)"
        )
    return lines


def equal_work_problems(results: dict[str, dict[str, Any]], completion_len: int) -> list[str]:
    """Where the two sides were not set up for the same work, in words (empty when they were)."""
    problems = []
    for side, r in results.items():
        if r.get("ok") and not r.get("completion_length_ok"):
            news = sorted({g["new_tokens"] for g in r.get("generations", [])})
            problems.append(
                f"{side}: completions were not all {completion_len} tokens (generated {news or 'nothing seen'}; "
                f"logged mean lengths {sorted(set(r.get('logged', {}).get('mean_length', {}).values()))})"
            )
    ok = [r for r in results.values() if r.get("ok")]
    if len(ok) == 2:
        for field in ("trainer_fields", "generation_fields"):
            a, b = ok[0].get(field, {}), ok[1].get(field, {})
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    problems.append(f"{field} {key}: baseline {a.get(key)!r}, hellbender {b.get(key)!r}")
        widths = [sorted({(g["prompt_min"], g["prompt_max"]) for g in r.get("generations", [])}) for r in ok]
        if widths[0] != widths[1]:
            problems.append(
                f"prompt tokens per generated sequence differ: baseline {widths[0]}, hellbender {widths[1]}"
            )
        if ok[0].get("params", {}).get("trainable") != ok[1].get("params", {}).get("trainable"):
            problems.append(f"trainable parameters differ: {ok[0].get('params')} vs {ok[1].get('params')}")
    return problems


def fmt(value: Any, spec: str) -> str:
    return pt.fmt(value, spec)


def print_report(args: argparse.Namespace, results: dict[str, dict[str, Any]], data_tokens: dict[str, Any]) -> bool:
    """Print the report; returns whether both sides did the same work."""
    env = next((r for r in results.values() if r.get("device")), {})
    cuda = env.get("gpu_memory_gib") is not None
    completions = args.prompts * args.generations
    print(
        f"\nW6 ({args.shape} shape, LoRA r{pt.LORA_R}, GRPO): device {env.get('device', '?')}; torch "
        f"{env.get('torch', '?')}, transformers {env.get('transformers', '?')}, peft {env.get('peft', '?')}; "
        f"{args.prompts} prompts x {args.generations} generations = {completions} completions per step (micro-batch "
        f"{args.micro_batch} x {completions // args.micro_batch} accumulation); {pt.lengths_text(data_tokens)} tokens, "
        f"completions {args.completion_len} tokens; {args.steps} steps, medians over steps "
        f"{args.warmup + 1}..{args.steps}"
    )
    print("\nhellbender settings that differ from the baseline:")
    for line in differing_settings(args, cuda):
        print(f"  - {line}")
    for side, r in results.items():
        if r.get("ok"):
            calls = r.get("generations") or []
            print(f"{side} features: {tp.features_text(r)}; {len(calls)} generate calls, "
                  f"{', '.join(sorted({str(g['sequences']) for g in calls}))} sequences each; peak allocated "
                  f"set inside generate: {fmt(r.get('generation_peak_gib') or None, '.2f')} GiB")  # fmt: skip
    problems = equal_work_problems(results, args.completion_len)
    print("\nsame work on both sides: " + ("yes" if not problems else "NO"))
    for line in problems:
        print(f"  - {line}")

    ok = {side: r for side, r in results.items() if r.get("ok")}
    if ok:
        steps = sorted({int(s) for r in ok.values() for s in r["logged"]["reward"]})
        print(
            "\nmean reward (share of even token ids) and gradient norm per step (the same seed and starting weights):"
        )
        print("| step | " + " | ".join(f"{side} reward | {side} grad norm" for side in ok) + " |")
        print("|---|" + "---|---|" * len(ok))
        for step in steps:
            cells = [f"{fmt(r['logged'][k].get(str(step)), f)}" for r in ok.values() for k, f in
                     (("reward", ".4f"), ("grad_norm", ".5g"))]  # fmt: skip
            print(f"| {step} | " + " | ".join(cells) + " |")

    print(
        "\n| side | s/step | completions/s | tokens/s | generate s/step | train s/step | peak alloc GiB "
        "| peak reserved GiB | setup s | completion len | speed-up hb/base | alloc hb/base |"
    )
    print("|---|" + "---|" * 11)
    base = results.get("baseline", {})
    for side, r in results.items():
        if not r.get("ok"):
            print(f"| {side} | failed: {r.get('reason')} |" + " |" * 11)
            continue
        ratios = ["—", "—"]
        if side == "hellbender" and base.get("ok"):
            ratios = [tp.ratio(base.get("step_s"), r.get("step_s")),
                      tp.ratio(r.get("peak_allocated_gib"), base.get("peak_allocated_gib"))]  # fmt: skip
        lengths = sorted(set(r["logged"]["mean_length"].values()))
        length = ", ".join(f"{v:g}" for v in lengths) + (" ok" if r.get("completion_length_ok") else " NOT EQUAL")
        print(
            f"| {side} | {fmt(r.get('step_s'), '.2f')} | {fmt(r.get('completions_per_s'), ',.2f')} "
            f"| {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('generate_s'), '.2f')} "
            f"| {fmt(r.get('train_s'), '.2f')} | {fmt(r.get('peak_allocated_gib'), '.1f')} "
            f"| {fmt(r.get('peak_reserved_gib'), '.1f')} | {fmt(r.get('setup_s'), '.0f')} | {length} "
            f"| {ratios[0]} | {ratios[1]} |"
        )
    return not problems


def parent_main(args: argparse.Namespace) -> int:
    # The toy model's defaults keep the CPU smoke check under two minutes on two cores.
    tiny = SHAPES[args.shape]
    for key, full, toy in (("steps", 8, 6), ("warmup", 2, 2), ("prompt_len", 256, 64), ("completion_len", 256, 32)):
        if getattr(args, key) is None:
            setattr(args, key, toy if tiny else full)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if (args.prompts * args.generations) % args.micro_batch:
        raise SystemExit("--micro-batch must divide --prompts x --generations (the completions of one step)")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--sides takes {', '.join(SIDES)}")
    if args.device != "cpu" and not SHAPES[args.shape] and not tp.cuda_available():
        raise SystemExit("CUDA is not available: the llama3.2-1b shape needs a GPU (use --shape tiny --device cpu)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(args)

    from transformers import AutoTokenizer

    spec = PromptSpec(args.prompt_len, args.steps * args.prompts)
    data = args.workdir / "data" / f"{spec.name}.jsonl"
    tokens_file = data.with_suffix(".tokens.json")
    if data.is_file() and tokens_file.is_file():
        data_tokens = json.loads(tokens_file.read_text())
    else:
        print(f"[data] writing {spec.rows} prompts to {data} ...", flush=True)
        data_tokens = write_prompts(data, spec, AutoTokenizer.from_pretrained(model_dir))
    print(f"[data] {data}: {pt.lengths_text(data_tokens)}", flush=True)

    results: dict[str, dict[str, Any]] = {}
    extra = ["--_model", str(model_dir), "--_data", str(data)]
    for side in sides:
        results[side] = {"side": side, **child(args, "run", [*extra, "--_side", side], side)}
        if args.json:
            payload = {"workload": "W6", "args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
                       "data_tokens": data_tokens, "results": results}  # fmt: skip
            tp.write_atomically(args.json, lambda target, p=payload: target.write_text(json.dumps(p, indent=2)))
    same_work = print_report(args, results, data_tokens)
    print(f"\ntotal {time.perf_counter() - pt.STARTED:.0f} s" + (f"; wrote {args.json}" if args.json else ""))
    return 0 if same_work and all(r.get("ok") for r in results.values()) else 1


def child_main(args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # deprecation chatter of transformers 5.x / TRL aliases
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.device == "cpu":
        # Toy models gain nothing from a second thread, and a busy neighbour makes torch's threads wait on each other.
        torch.set_num_threads(1)
    if args._child == "build":
        tiny = SHAPES[args.shape]
        result = pt.save_model(args.workdir, tp.workload("W2", tiny), tiny)
    else:
        result = run_side(args)
    Path(args._result).write_text(json.dumps(result, indent=2))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3.2-1b", help="model shape (default llama3.2-1b)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: hide the GPU from both sides")
    p.add_argument("--sides", default="baseline,hellbender", help="which sides to run (default both)")
    p.add_argument("--steps", type=int, help="optimizer steps per side (default 8; tiny shape: 6)")
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default 2)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per optimizer step (default 8)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt, num_generations (default 8)")
    p.add_argument("--micro-batch", type=int, default=8, help="completions per micro-batch (default 8)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens, chat template included (default 256; tiny: 64)")
    p.add_argument("--completion-len", type=int, help="tokens of every completion (default 256; tiny shape: 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--hb-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra hellbender config key, `trl.KEY` for the trl block (repeatable)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"), help="models, data, runs (reused)")
    p.add_argument("--json", type=Path, help="also write every result to this JSON file")
    p.add_argument("--child-timeout-s", type=float, default=540, help="wall-clock cap of one side's subprocess")
    for hidden in ("--_child", "--_result", "--_side", "--_model", "--_data"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args._child:
        child_main(args)
        return
    sys.exit(parent_main(args))


if __name__ == "__main__":
    main()
