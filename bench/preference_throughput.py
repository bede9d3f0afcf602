"""W5: DPO throughput and memory, plain TRL DPOTrainer + PEFT against hellbender, on the same model, pairs and weights.

GPU command (one H100; `.whl/` carried along, e.g. the run tool's `carry: [".whl"]`), both sides in one invocation,
expected to take about 5 minutes with a fresh 8B build (under 8):

    bash bench/setup_gpu.sh > /tmp/pythonpath && . /tmp/pythonpath && export PYTHONUNBUFFERED=1 &&
    python3 bench/preference_throughput.py --json $OUT/w5.json 2>&1 | tee $OUT/w5.log

CPU smoke check (toy model, about a minute on two cores):

    python bench/preference_throughput.py --shape tiny --device cpu --workdir /tmp/SOMEWHERE

Workload (`--shape llama3-8b`, the default): the Llama-3-8B shape of bench/throughput.py (random weights, bf16,
SDPA; the same saved directory as its W1, so a machine that ran W1 reuses the build), LoRA r16 alpha 32 on every
linear layer of the decoder, DPO (sigmoid loss, beta 0.1) on synthetic chat pairs of `--prompt-len` (1024) prompt
tokens and `--answer-len` (1024) tokens for each answer, micro-batch `--micro-batch` (2) pairs, gradient
accumulation `--grad-accum` (1), `--steps` (20) optimizer steps at a constant learning rate of 5e-5.

The two sides, each in its own subprocess (no allocator state carries over; the parent never touches the GPU):
  baseline    what TRL's documentation shows: `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`, the rows as a
              conversational `datasets` JSON dataset (`prompt` / `chosen` / `rejected` message lists),
              `DPOTrainer(model, args=DPOConfig(...), train_dataset, processing_class=tokenizer,
              peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))`. DPOConfig keeps TRL's
              defaults (its gradient checkpointing is on by default, the reference is the base model with the adapter
              switched off) except what a user sets for this data: `max_length` = prompt + answer length (TRL's
              default 1024 would cut the answers), the batch, steps, learning rate and schedule.
  hellbender  the same pairs as a `chat_template.default` dataset (`field_messages: prompt`) and `rl: dpo`, trained
              by `hellbender.train.run.train`, with the recipe a user picks for speed on a GPU: `torch_compile: true`
              (each decoder layer's checkpoint call compiled; it does not combine with Liger's kernels, which measured
              slower here), hellbender's activation checkpointing, and each pair scored in one row that holds its
              prompt once (`dpo_shared_prompt`, on by default on a GPU). `--hb-set KEY=VALUE` adds or replaces keys
              (e.g. `torch_compile=false --hb-set liger_rope=true` for the earlier Liger recipe,
              `gradient_checkpointing_layers=28`). Every key that differs from the baseline is printed.
Set on both sides so that their losses can be compared step by step (none changes the work of a step): the rows are
drawn in dataset order (the baseline's `train_sampling_strategy="sequential"`, hellbender's `curriculum_sampling`),
and every LoRA A matrix is set, before the first step, to the same values drawn from its module name (B stays 0, so
the first step's loss is log 2 on both sides). The optimizer is `adamw_torch_fused` on a GPU on both sides (the
default of each), `adamw_torch` on CPU.

Measurements (as bench/throughput.py, whose step recorder this script uses):
- pairs/s: pairs per optimizer step / wall time between consecutive step ends after `torch.cuda.synchronize()`,
  median over steps `--warmup`+1..`--steps`. tokens/s counts the tokens of the policy's forward (chosen and rejected
  rows, from the attention mask); the reference forward (without gradients) scores the same tokens again and is not
  counted a second time.
- peak alloc / reserved: `max_memory_allocated` / `max_memory_reserved` from the start of training (the model already
  on the GPU) to its end.
- setup s: from the child's start to its first step (imports, model load, data preparation, and anything a recipe
  does before training, such as `precompute_ref_log_probs` scoring every pair), shown beside pairs/s so that work
  moved before the first step is not hidden.
- loss: the loss the Trainer logs at each step (`logging_steps` 1 on both sides), printed side by side.
- token counts: of the prepared rows of each side (prompt, chosen, rejected), the sequence length of the batch the
  policy's forward is given, and the rows x tokens its decoder runs (one row per pair with `dpo_shared_prompt`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # shapes, model building and the step recorder come from the sibling benchmark
    sys.path.insert(0, str(HERE))

import throughput as tp  # noqa: E402

SIDES = ("baseline", "hellbender")
SHAPES = {"llama3-8b": False, "tiny": True}  # name -> bench/throughput.py's `tiny` flag
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 5e-5
BETA = 0.1
STARTED = time.perf_counter()

# ---------------------------------------------------------------------------------------------------------------
# Data: chat pairs of an exact token length (written by the parent, read by both sides)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairSpec:
    prompt_len: int
    answer_len: int
    rows: int

    @property
    def name(self) -> str:
        return f"pairs-p{self.prompt_len}-a{self.answer_len}-rows{self.rows}"


def one_token_words(tokenizer: Any) -> list[str]:
    """Words that are a single token after a space: they fill the last few tokens of a text exactly."""
    return [w for w in tp.WORDS if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]


def fitted_text(
    estimate: Callable[[str], int],
    exact: Callable[[str], int],
    target: int,
    rng: random.Random,
    fillers: list[str],
    capital: str,
) -> str:
    """A text of random words for which `exact(text)` is `target` tokens (or the nearest above it can be): random
    words while `estimate` (the words alone, cheap) says more than a few tokens are missing, then one-token words one
    at a time, counted exactly (through the chat template)."""
    words = [capital]
    while estimate(" ".join(words)) < target - 8:
        words += rng.choices(tp.WORDS, k=max(1, (target - estimate(" ".join(words))) // 3))
        while (over := estimate(" ".join(words)) - (target - 4)) > 0 and len(words) > 1:
            del words[max(1, len(words) - max(1, over // 4)) :]  # overshot: back off to a few tokens short
    while exact(" ".join(words)) > target and len(words) > 1:
        words.pop()
    while exact(" ".join(words)) < target:
        words.append(rng.choice(fillers))
    return " ".join(words)


def write_pairs(path: Path, spec: PairSpec, tokenizer: Any) -> dict[str, Any]:
    """`spec.rows` pairs as TRL's conversational preference rows, each prompt `spec.prompt_len` tokens as the chat
    template renders it for generation, each answer `spec.answer_len` tokens through its end-of-turn token (the
    template's text after it, a newline, is not counted); returns the measured counts."""
    rng = random.Random(tp.SEED)
    fillers = one_token_words(tokenizer)
    if not fillers:
        raise SystemExit("the tokenizer has no one-token word among the benchmark's words: cannot fit exact lengths")
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(messages: list[dict[str, str]], generation: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def prompt_tokens(text: str) -> int:
        return len(render([{"role": "user", "content": text}], True))

    def words_only(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # What the template adds around a text, for the cheap estimate (the exact count renders the template).
    prompt_markup = prompt_tokens("Why") - words_only("Why")

    counts: dict[str, list[int]] = {"prompt": [], "chosen": [], "rejected": []}
    rows = []
    for _ in range(spec.rows):
        prompt = [
            {
                "role": "user",
                "content": fitted_text(
                    lambda text: prompt_markup + words_only(text), prompt_tokens, spec.prompt_len, rng, fillers, "Why"
                ),
            }
        ]
        prompt_ids = render(prompt, True)

        def answer_tokens(text: str, prompt: list[dict[str, str]] = prompt, start: int = len(prompt_ids)) -> int:
            full = render([*prompt, {"role": "assistant", "content": text}], False)
            return len(full[start : full.index(end_of_turn, start) + 1])

        row: dict[str, Any] = {"prompt": prompt}
        counts["prompt"].append(len(prompt_ids))
        for key, capital in (("chosen", "Because"), ("rejected", "Perhaps")):
            # The answer's own markup is its end-of-turn token.
            text = fitted_text(lambda t: words_only(t) + 1, answer_tokens, spec.answer_len, rng, fillers, capital)
            row[key] = [{"role": "assistant", "content": text}]
            counts[key].append(answer_tokens(text))
        rows.append(row)
    tp.write_atomically(path, lambda target: target.write_text("".join(json.dumps(r) + "\n" for r in rows)))
    stats = {key: summary(values) for key, values in counts.items()}
    path.with_suffix(".tokens.json").write_text(json.dumps(stats))
    return stats


def summary(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": statistics.fmean(values)} if values else {}


def lengths_text(stats: dict[str, dict[str, float]]) -> str:
    def one(s: dict[str, float]) -> str:
        if not s:
            return "?"
        return f"{s['min']:.0f}" if s["min"] == s["max"] else f"{s['min']:.0f}-{s['max']:.0f} (mean {s['mean']:.1f})"

    return ", ".join(f"{key} {one(s)}" for key, s in stats.items())


# ---------------------------------------------------------------------------------------------------------------
# Shared by both sides: the same LoRA start, the recorder with per-step losses and token counts
# ---------------------------------------------------------------------------------------------------------------


def layer_key(name: str) -> str:
    """A LoRA weight's name without its wrappers' prefixes (`base_model.model.model.` and the like), so that the
    same module has the same key on both sides."""
    index = name.find("layers.")
    return name[index:] if index >= 0 else name


def same_adapter_start(model: Any) -> dict[str, Any]:
    """Set every LoRA A matrix to values drawn from its module's name (PEFT's default bound, 1/sqrt(fan_in)) and
    every B to zero, so that both sides start from identical weights whatever random state their set-up consumed."""
    import torch

    a_count = b_count = 0
    dtypes = set()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name:
                generator = torch.Generator().manual_seed(zlib.crc32(layer_key(name).encode()))
                bound = 1.0 / math.sqrt(parameter.shape[1])
                values = torch.rand(parameter.shape, generator=generator, dtype=torch.float32) * 2 * bound - bound
                parameter.copy_(values.to(parameter.device, parameter.dtype))
                a_count += 1
                dtypes.add(str(parameter.dtype).removeprefix("torch."))
            elif ".lora_B." in name:
                parameter.zero_()
                b_count += 1
    if a_count == 0 or a_count != b_count:
        raise SystemExit(f"expected LoRA A and B matrices in pairs, found {a_count} A and {b_count} B")
    return {"adapter": f"LoRA on {a_count} modules, same start, {'/'.join(sorted(dtypes))} weights"}


class PreferenceRecorder(tp.StepRecorder):
    """bench/throughput.py's step recorder, plus the logged loss of each step, the sequence length of the policy's
    forward, the prepared rows' token counts, and the LoRA start shared by both sides."""

    def __init__(self, label: str, total_steps: int, warmup: int, features: dict[str, Any]):
        super().__init__(label, total_steps, warmup, None, features)
        self.losses: dict[int, float] = {}
        self.margins: dict[int, float] = {}
        self.sequence_lengths: set[int] = set()
        self.backbone_rows: set[tuple[int, ...]] = set()
        self.dataset_tokens: dict[str, dict[str, float]] = {}
        self.setup_s: float | None = None

    def _count_rows(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and module.training and torch.is_grad_enabled():
            self.sequence_lengths.add(int(ids.shape[1]))
        super()._count_rows(module, args, kwargs)

    def _backbone_rows(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and torch.is_grad_enabled():
            self.backbone_rows.add(tuple(ids.shape))

    def on_train_begin_with(self, args: Any, model: Any, train_dataloader: Any) -> None:
        self.features.update(same_adapter_start(model))
        # What the decoder runs, which hellbender's shared-prompt rows (`dpo_shared_prompt`) make differ from the batch.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.get_decoder().register_forward_pre_hook(self._backbone_rows, with_kwargs=True)
        dataset = getattr(train_dataloader, "dataset", None)
        columns = getattr(dataset, "column_names", None) or []
        for column, key in (("prompt_ids", "prompt"), ("chosen_ids", "chosen"), ("rejected_ids", "rejected")):
            if column in columns:
                self.dataset_tokens[key] = summary([len(ids) for ids in dataset[column]])
        self.setup_s = time.perf_counter() - STARTED
        super().on_train_begin(args, model)

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class Recorder(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
                recorder.on_train_begin_with(args, model, train_dataloader)

            def on_step_begin(self, args, state, control, **kwargs):
                recorder.on_step_begin(state.global_step + 1)

            def on_step_end(self, args, state, control, **kwargs):
                recorder.on_step_end(state.global_step)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    recorder.losses[state.global_step] = float(logs["loss"])
                if logs and "rewards/margins" in logs:
                    recorder.margins[state.global_step] = float(logs["rewards/margins"])

            def on_train_end(self, args, state, control, **kwargs):
                recorder.on_train_end()

        return Recorder()

    def result(self, pairs_per_step: int) -> dict[str, Any]:
        out = self.summary()
        steady = [s for s in self.steps if s["step"] > self.warmup] or self.steps
        if steady:
            out["pairs_per_s"] = statistics.median(pairs_per_step / s["seconds"] for s in steady)
        out.update(
            pairs_per_step=pairs_per_step,
            losses={str(k): v for k, v in sorted(self.losses.items())},
            margins={str(k): v for k, v in sorted(self.margins.items())},
            sequence_lengths=sorted(self.sequence_lengths),
            backbone_rows=sorted(self.backbone_rows),
            dataset_tokens=self.dataset_tokens,
            setup_s=self.setup_s,
        )
        return out


# ---------------------------------------------------------------------------------------------------------------
# The two sides (each in a child process)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    side: str
    model_dir: Path
    data: Path
    workdir: Path
    spec: PairSpec
    micro_batch: int
    grad_accum: int
    steps: int
    cuda: bool

    @property
    def output_dir(self) -> Path:
        return self.workdir / "runs" / f"W5-{self.side}"

    @property
    def optimizer(self) -> str:
        return "adamw_torch_fused" if self.cuda else "adamw_torch"


def baseline_model_and_rows(job: Any) -> tuple[Any, Any, Any]:
    """The baseline's tokenizer, bf16 model (on the GPU, where the Trainer would move it: done here so setup_s
    compares like for like) and rows, as TRL's documentation loads them."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=torch.bfloat16 if job.cuda else torch.float32, attn_implementation="sdpa"
    )
    if job.cuda:
        model = model.to("cuda")
    return tokenizer, model, load_dataset("json", data_files=str(job.data), split="train")


def train_baseline(job: Job, recorder: PreferenceRecorder) -> None:
    """Plain TRL + PEFT, as TRL's documentation writes a LoRA DPO run."""
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    tokenizer, model, dataset = baseline_model_and_rows(job)
    args = DPOConfig(
        output_dir=str(job.output_dir),
        per_device_train_batch_size=job.micro_batch,
        gradient_accumulation_steps=job.grad_accum,
        max_steps=job.steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=BETA,
        max_length=job.spec.prompt_len + job.spec.answer_len,
        bf16=job.cuda,
        optim=job.optimizer,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=tp.SEED,
        train_sampling_strategy="sequential",  # the rows in file order, as hellbender's side (comparable losses)
    )
    recorder.features.update(
        # kwargs None: transformers 5's default, non-reentrant.
        checkpointing=f"transformers' (TRL's default gradient_checkpointing={args.gradient_checkpointing}, "
        f"gradient_checkpointing_kwargs={args.gradient_checkpointing_kwargs})",
        reference="base model, adapter switched off",
    )
    peft_config = LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[recorder.callback()],
    )
    trainer.train()


# The hellbender keys of the speed recipe, beside the baseline's settings (GPU only: Liger needs CUDA).
# What a user sets for speed on a GPU. DPO: each decoder layer's checkpoint call compiled (measured faster than
# Liger's kernels on W5; the two do not combine). The online-RL benchmark keeps Liger's kernels (generation runs the
# same layers uncompiled).
SPEED_RECIPE = {"liger_rope": True, "liger_rms_norm": True, "liger_glu_activation": True}
DPO_SPEED_RECIPE = {"torch_compile": True}


def hellbender_raw_config(job: Job, overrides: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "base_model": str(job.model_dir),
        "rl": "dpo",
        "rl_beta": BETA,
        "datasets": [{"path": str(job.data), "type": "chat_template.default", "field_messages": "prompt"}],
        "sequence_len": job.spec.prompt_len + job.spec.answer_len,
        "excess_length_strategy": "raise",  # no pair may vanish silently: both sides must see the same rows
        "curriculum_sampling": True,  # dataset order, as the baseline's sequential sampler (comparable losses)
        **run_keys(job, LEARNING_RATE, DPO_SPEED_RECIPE),
    }
    raw.update(overrides)
    return raw


def run_keys(job: Any, learning_rate: float, recipe: dict[str, Any] = SPEED_RECIPE) -> dict[str, Any]:
    """The hellbender keys every benchmark run of a TRL method shares: its batch and schedule, LoRA on every linear
    layer, checkpointing, no checkpoint saved mid-run, and on a GPU the speed `recipe`."""
    return {
        "micro_batch_size": job.micro_batch,
        "gradient_accumulation_steps": job.grad_accum,
        "max_steps": job.steps,
        "learning_rate": learning_rate,
        "lr_scheduler": "constant",
        "optimizer": job.optimizer,
        "adapter": "lora",
        "lora_r": LORA_R,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "gradient_checkpointing": True,
        "bf16": job.cuda,
        "save_steps": job.steps + 1000,  # no checkpoint during the run (the final adapter is saved after timing)
        "logging_steps": 1,
        "memory_watchdog": "off",
        "seed": tp.SEED,
        "output_dir": str(job.output_dir),
        "dataset_prepared_path": str(job.workdir / "prepared"),
        **(recipe if job.cuda else {}),
    }


def record_kernels(cfg: Any, features: dict[str, Any]) -> None:
    kernels = sorted(k for k, v in cfg.model_dump().items() if k.startswith("liger_") and v)
    if kernels:
        features["kernels"] = ",".join(kernels)


def train_hellbender(job: Job, recorder: PreferenceRecorder, overrides: dict[str, Any]) -> None:
    from hellbender.config import validate_config
    from hellbender.train.run import train

    cfg = validate_config(hellbender_raw_config(job, overrides))
    mode = cfg.gradient_checkpointing
    layers = getattr(cfg, "gradient_checkpointing_layers", None)
    recorder.features.update(
        checkpointing=f"hellbender ({'offload' if mode == 'offload' else 'on' if mode else 'off'}"
        + (f", first {layers} layers" if layers is not None else "")
        + ")",
        reference="precomputed before training" if cfg.precompute_ref_log_probs else "base model, adapter switched off",
    )
    record_kernels(cfg, recorder.features)
    train(cfg, callbacks=[recorder.callback()])


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    spec = PairSpec(args.prompt_len, args.answer_len, args._rows)
    job = Job(args._side, Path(args._model), Path(args._data), args.workdir, spec, args.micro_batch,
              args.grad_accum, args.steps, cuda)  # fmt: skip
    recorder = PreferenceRecorder(f"W5 {job.side}", job.steps, args.warmup, {})
    sides = {"baseline": train_baseline, "hellbender": train_hellbender}
    return timed_side(job, recorder, sides, args.hb_set, job.micro_batch * job.grad_accum)


def timed_side(job: Any, recorder: Any, sides: dict[str, Callable[..., None]], hb_set: list[str], units: int) -> dict:
    """Train `job.side` with its function of `sides` (hellbender's also takes the `--hb-set` keys) in a fresh output
    directory, removed afterwards, and return the recorder's result for `units` pairs or completions per step."""
    shutil.rmtree(job.output_dir, ignore_errors=True)  # never resume from an earlier run's checkpoints
    started = time.perf_counter()
    try:
        if job.side == "baseline":
            sides["baseline"](job, recorder)
        else:
            sides["hellbender"](job, recorder, tp.parse_overrides(hb_set))
    finally:
        shutil.rmtree(job.output_dir, ignore_errors=True)
    return {
        "side": job.side,
        "ok": True,
        **tp.environment(),
        **recorder.result(units),
        "wall_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------------------------------------
# Parent: model, data, the two children, the tables
# ---------------------------------------------------------------------------------------------------------------


def child(
    args: argparse.Namespace,
    kind: str,
    extra: list[str],
    label: str,
    script: Path = Path(__file__),
    forward: Callable[[argparse.Namespace], list[str]] | None = None,
    prefix: str = "W5",
) -> dict[str, Any]:
    """Run `script` (this file, or a sibling benchmark that shares this launcher) as a child of `kind` with the
    parent's options (`forward`, this script's `forwarded` by default) and return the JSON it writes."""
    results = args.workdir / "results"
    results.mkdir(parents=True, exist_ok=True)
    result_file = results / f"{prefix}-{label}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(script.resolve()), *(forward or forwarded)(args), "--_child", kind]
    command += ["--_result", str(result_file), *extra]
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("HF_DATASETS_CACHE", str(args.workdir / "hf-datasets"))
    env.setdefault("HELLBENDER_CACHE", str(args.workdir / "hellbender-cache"))
    # One card (the Trainer would wrap the model in DataParallel), or none with --device cpu.
    env["CUDA_VISIBLE_DEVICES"] = "" if args.device == "cpu" else env.get("CUDA_VISIBLE_DEVICES", "0")
    try:
        rc: int | str = subprocess.run(command, env=env, timeout=args.child_timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc == 0 and result_file.is_file():
        return json.loads(result_file.read_text())
    print(f"[{label}] failed: {'timeout' if rc == 'timeout' else f'exit code {rc}'} (its output is above)", flush=True)
    return {"ok": False, "reason": f"exit code {rc}" if rc != "timeout" else "timeout"}


def forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--shape", args.shape, "--device", args.device, "--workdir", str(args.workdir)]
    out += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch)]
    out += ["--grad-accum", str(args.grad_accum), "--prompt-len", str(args.prompt_len)]
    out += ["--answer-len", str(args.answer_len)]
    for item in args.hb_set:
        out += ["--hb-set", item]
    return out


def ensure_model(args: argparse.Namespace, w: tp.Workload) -> Path:
    target = args.workdir / "models" / w.model_key
    if tp.model_is_built(target, tp.model_spec(w, SHAPES[args.shape])):
        print(f"[build {w.model_key}] reusing {target}", flush=True)
        return target
    if not child(args, "build", [], f"build-{w.model_key}").get("ok"):
        raise SystemExit("building the model failed (its output is above)")
    return target


def build_model(args: argparse.Namespace) -> dict[str, Any]:
    """The W1 model of bench/throughput.py, saved where its W1 saves it (the spec marker says which shape)."""
    tiny = SHAPES[args.shape]
    return save_model(args.workdir, tp.workload("W1", tiny), tiny)


def save_model(workdir: Path, w: tp.Workload, tiny: bool) -> dict[str, Any]:
    """Build workload `w`'s model of bench/throughput.py and save it under `workdir`/models, where its workload
    saves it, with the spec marker that says which shape it is."""
    target = workdir / "models" / w.model_key
    staging = target.with_name(f".{target.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    print(f"[build {w.model_key}] building with random weights ...", flush=True)
    started = time.perf_counter()
    facts = tp.build_model(w, staging, tiny)
    (staging / tp.MODEL_SPEC_FILE).write_text(json.dumps(tp.model_spec(w, tiny)))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    print(f"[build {w.model_key}] {facts['parameters'] / 1e9:.2f}B parameters, {time.perf_counter() - started:.0f} s")
    return {"ok": True, **facts}


def differing_settings(args: argparse.Namespace, cuda: bool) -> list[str]:
    """What the hellbender side sets beyond the baseline's settings, for the report."""
    job = Job("hellbender", Path("model"), Path("data"), args.workdir, PairSpec(1, 1, 1), 1, 1, 1, cuda)
    raw = hellbender_raw_config(job, tp.parse_overrides(args.hb_set))
    # The baseline checkpoints (TRL's default) and reads rows in order; any other key it does not have is off.
    baseline = {"gradient_checkpointing": True, "curriculum_sampling": True}
    keys = [*(DPO_SPEED_RECIPE if cuda else {}), *tp.parse_overrides(args.hb_set)]
    lines = [f"{k}: {raw[k]}" for k in dict.fromkeys(keys) if raw.get(k) != baseline.get(k, False)]
    lines.append("activation checkpointing: hellbender's (non-reentrant, per layer) instead of transformers'")
    return lines


def fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_report(args: argparse.Namespace, results: dict[str, dict[str, Any]], data_tokens: dict[str, Any]) -> None:
    env = next((r for r in results.values() if r.get("device")), {})
    cuda = env.get("gpu_memory_gib") is not None
    print(
        f"\nW5 ({args.shape} shape, LoRA r{LORA_R}, DPO): device {env.get('device', '?')}; torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}, peft {env.get('peft', '?')}; micro-batch {args.micro_batch} "
        f"pairs x {args.grad_accum} accumulation; {args.steps} steps, medians over steps {args.warmup + 1}..{args.steps}"
    )
    print(f"rows as written (hellbender's count: an answer ends at its end-of-turn): {lengths_text(data_tokens)}")
    for side, r in results.items():
        if r.get("ok"):
            print(
                f"{side}: prepared rows {lengths_text(r.get('dataset_tokens') or {})}; the policy's forward sees "
                f"sequences of {', '.join(map(str, r.get('sequence_lengths') or [])) or '?'} tokens; its decoder runs "
                f"rows x tokens {', '.join('x'.join(map(str, s)) for s in r.get('backbone_rows') or []) or '?'}"
            )
    print("\nhellbender settings that differ from the baseline:")
    for line in differing_settings(args, cuda):
        print(f"  - {line}")
    for side, r in results.items():
        if r.get("ok"):
            print(f"{side} features: {tp.features_text(r)}")

    ok = {side: r for side, r in results.items() if r.get("ok")}
    if len(ok) == 2:
        base, hb = ok["baseline"]["losses"], ok["hellbender"]["losses"]
        print("\nloss per step (both start from the same weights; step 1 is log 2 = 0.693147):")
        print("| step | baseline | hellbender | difference |")
        print("|---|---|---|---|")
        for step in sorted({*base, *hb}, key=int)[: args.show_losses]:
            b, h = base.get(step), hb.get(step)
            diff = f"{h - b:+.6f}" if b is not None and h is not None else "—"
            print(f"| {step} | {fmt(b, '.6f')} | {fmt(h, '.6f')} | {diff} |")

    print(
        "\n| side | pairs/s | tokens/s | peak alloc GiB | peak reserved GiB | setup s | pairs/s hb/base | alloc hb/base |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = results.get("baseline", {})
    for side, r in results.items():
        if not r.get("ok"):
            print(f"| {side} | failed: {r.get('reason')} | | | | | | |")
            continue
        ratios = ["—", "—"]
        if side == "hellbender" and base.get("ok"):
            ratios = [tp.ratio(r.get("pairs_per_s"), base.get("pairs_per_s")),
                      tp.ratio(r.get("peak_allocated_gib"), base.get("peak_allocated_gib"))]  # fmt: skip
        print(
            f"| {side} | {fmt(r.get('pairs_per_s'), ',.2f')} | {fmt(r.get('tokens_per_s'), ',.0f')} "
            f"| {fmt(r.get('peak_allocated_gib'), '.1f')} | {fmt(r.get('peak_reserved_gib'), '.1f')} "
            f"| {fmt(r.get('setup_s'), '.0f')} | {ratios[0]} | {ratios[1]} |"
        )


def parent_main(args: argparse.Namespace) -> int:
    tiny = SHAPES[args.shape]
    args.steps = args.steps or (8 if tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (3 if tiny else 5)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--sides takes {', '.join(SIDES)}")
    if args.device != "cpu" and not SHAPES[args.shape] and not tp.cuda_available():
        raise SystemExit("CUDA is not available: the llama3-8b shape needs a GPU (use --shape tiny --device cpu)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(args, tp.workload("W1", SHAPES[args.shape]))

    from transformers import AutoTokenizer

    spec = PairSpec(args.prompt_len, args.answer_len, args.steps * args.micro_batch * args.grad_accum)
    data = args.workdir / "data" / f"{spec.name}.jsonl"
    tokens_file = data.with_suffix(".tokens.json")
    if data.is_file() and tokens_file.is_file():
        data_tokens = json.loads(tokens_file.read_text())
    else:
        print(f"[data] writing {spec.rows} pairs to {data} ...", flush=True)
        data_tokens = write_pairs(data, spec, AutoTokenizer.from_pretrained(model_dir))
    print(f"[data] {data}: {lengths_text(data_tokens)}", flush=True)

    results: dict[str, dict[str, Any]] = {}
    extra = ["--_model", str(model_dir), "--_data", str(data), "--_rows", str(spec.rows)]
    for side in sides:
        results[side] = {"side": side, **child(args, "run", [*extra, "--_side", side], side)}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            payload = {"workload": "W5", "args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
                       "data_tokens": data_tokens, "results": results}  # fmt: skip
            tp.write_atomically(args.json, lambda target, p=payload: target.write_text(json.dumps(p, indent=2)))
    print_report(args, results, data_tokens)
    print(f"\ntotal {time.perf_counter() - STARTED:.0f} s" + (f"; wrote {args.json}" if args.json else ""))
    return 0 if all(r.get("ok") for r in results.values()) else 1


def child_main(args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # deprecation chatter of transformers 5.x / TRL aliases
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.device == "cpu":
        # Toy models gain nothing from a second thread, and a busy neighbour makes torch's threads wait on each other.
        torch.set_num_threads(1)
    result = build_model(args) if args._child == "build" else run_side(args)
    Path(args._result).write_text(json.dumps(result, indent=2))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b", help="model shape (default llama3-8b)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: hide the GPU from both sides")
    p.add_argument("--sides", default="baseline,hellbender", help="which sides to run (default both)")
    p.add_argument("--steps", type=int, help="optimizer steps per side (default 20; tiny shape: 8)")
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default 5; tiny shape: 3)")
    p.add_argument("--micro-batch", type=int, default=2, help="pairs per micro-batch (default 2)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per pair (default 1024)")
    p.add_argument("--answer-len", type=int, default=1024, help="tokens of each answer (default 1024)")
    p.add_argument(
        "--hb-set", action="append", default=[], metavar="KEY=VALUE", help="extra hellbender config key (repeatable)"
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"), help="models, data, runs (reused)")
    p.add_argument("--json", type=Path, help="also write every result to this JSON file")
    p.add_argument("--show-losses", type=int, default=10, help="steps of the side-by-side loss table (default 10)")
    p.add_argument("--child-timeout-s", type=float, default=540, help="wall-clock cap of one side's subprocess")
    for hidden in ("--_child", "--_result", "--_side", "--_model", "--_data"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--_rows", type=int, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args._child:
        child_main(args)
        return
    sys.exit(parent_main(args))


if __name__ == "__main__":
    main()
