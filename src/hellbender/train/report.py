"""The run report: `output_dir/report/` holds plots of loss, learning rate, tokens/s and memory per step, and
`report.md`, one page to judge the run by: what was trained on what, how the loss went, what the data
preparation kept and dropped, throughput, memory, wall time, the final metrics and the resolved config.

`RunReport` writes it after every checkpoint save and at the end of training. Drawing the plots takes a fraction
of a second; at a save they are redrawn only when that keeps drawing under `MAX_DRAWING_SHARE` of the time since
the last drawing (so always, where saves are minutes apart), and the page then says which step they show. Each
file is replaced atomically (temporary file, then rename), so a run killed while writing leaves the previous
report whole; the report lives outside the checkpoints and the final model, so it never affects what a resumed
run trusts.
"""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from statistics import median
from typing import Any

from transformers import TrainerCallback

from hellbender.config import HellbenderConfig, dump_config
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.metrics import perplexity
from hellbender.storage import write_file_atomically
from hellbender.train.divergence import Divergence
from hellbender.train.memory_watchdog import MemoryWatchdog
from hellbender.train.plots import (
    GIB,
    MIB,
    PLOTS,
    memory_labels,
    method_plots_logged,
    report_plots,
    train_logs,
)
from hellbender.train.preference_outcome import is_preference_log, preference_lines
from hellbender.train.rl_outcome import eval_reward_lines, is_rl_log, reward_lines, reward_notes

logger = logging.getLogger("hellbender")
REPORT_DIR = "report"
SUMMARY_NAME = "report.md"
MAX_DRAWING_SHARE = 0.05
DRAWING_SECONDS_GUESS = 0.3  # what drawing costs, until this process has measured it


class RunReport(TrainerCallback):
    """Writes the run report at every save and at the end of training (on the main process only).

    `data_stats` are the prepared data's statistics (`PreparedData.stats`; None for streamed data), `memory`
    the memory watchdog whose samples give the memory plot (None when it is off)."""

    def __init__(
        self,
        cfg: HellbenderConfig,
        data_stats: dict[str, Any] | None,
        memory: MemoryWatchdog | None = None,
        divergence: Divergence | None = None,
    ) -> None:
        self.cfg = cfg
        self.data_stats = data_stats
        self.memory = memory
        self.divergence = divergence
        self.started: float | None = None
        self.first_step = 0
        self.parameters: tuple[int, int] | None = None  # (trainable, total)
        self.drawn: dict[str, bool | str] = {}  # plot file -> drawn, or why not (as of the last drawing)
        self.drawn_at_step: int | None = None
        self._drawing_seconds = DRAWING_SECONDS_GUESS
        self._drawn_at = time.monotonic()  # when the last drawing ended (or training began)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.started = self._drawn_at = time.monotonic()
        self.first_step = state.global_step
        if model is not None:
            trainable = sum(_numel(p) for p in model.parameters() if p.requires_grad)
            self.parameters = (trainable, sum(_numel(p) for p in model.parameters()))
        if state.max_steps and state.global_step >= state.max_steps:
            # Resumed from the last checkpoint: no step runs and training ends without `on_train_end`.
            self.write(Path(args.output_dir), state, "end")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.write(Path(args.output_dir), state, "save")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.write(Path(args.output_dir), state, "end")

    def write(self, output_dir: Path, state: Any, moment: str) -> None:
        if not state.is_world_process_zero:
            return
        directory = output_dir / REPORT_DIR
        try:
            plots = self._plots(state) if self._draw_now(moment, state.global_step) else {}
            write_report(directory, self._page(state, moment), plots)
        except Exception as exc:  # a report that cannot be drawn must not end a training run; it says so instead
            logger.warning("The run report in %s could not be written: %s: %s", directory, type(exc).__name__, exc)

    # ---------------------------------------------------------------------------------------------- plots

    def _draw_now(self, moment: str, step: int) -> bool:
        if moment == "end":  # unless this step's save drew them: every plotted value is the same since
            return self.drawn_at_step != step
        return self._drawing_seconds <= MAX_DRAWING_SHARE * (time.monotonic() - self._drawn_at)

    def _plots(self, state: Any) -> dict[str, bytes | str]:
        """PNG bytes per plot file, or the reason a plot is missing; remembered for the page."""
        started = time.monotonic()
        off = "the memory watchdog is off (`memory_watchdog: off`), so memory was not recorded"
        plots = report_plots(state.log_history, self.memory.samples if self.memory is not None else off)
        self._drawn_at = time.monotonic()
        self._drawing_seconds = self._drawn_at - started
        self.drawn = {name: True if isinstance(content, bytes) else content for name, content in plots.items()}
        self.drawn_at_step = state.global_step
        return plots

    # ---------------------------------------------------------------------------------------------- page

    def _page(self, state: Any, moment: str) -> str:
        cfg = self.cfg
        history = state.log_history
        train = train_logs(history)
        evals = [e for e in history if "eval_loss" in e]
        summary = next((e for e in reversed(history) if "train_runtime" in e), None)
        lines = [f"# Training report: `{Path(cfg.output_dir).name}`", "", self._status(state, moment), ""]
        lines += ["## Run", "", *self._run_lines(), ""]
        # A preference or reward-model loss is no cross-entropy: its exponential is no perplexity.
        # Nor is a distillation loss (the logged `ce_loss` part is, but evaluation reports the whole loss), nor one
        # that holds a router's auxiliary loss.
        cross_entropy = self.cfg.rl is None and not self.cfg.reward_model and not self.cfg.distills
        cross_entropy = cross_entropy and not any("aux_loss" in e for e in train)
        outcome = self._outcome(train, evals, summary, cross_entropy)
        if is_preference_log(history):  # after the losses: what says whether the preference was learned
            outcome[2:2] = preference_lines(history)
        elif is_rl_log(history):  # its losses are no progress measure (they stay near 0): the rewards take their lines
            evaluated = [i for i, line in enumerate(outcome) if line.startswith("- Evaluation loss")]
            if evaluated:
                outcome[evaluated[0] : evaluated[0] + 1] = eval_reward_lines(evals) if evals else []
            outcome[0:1] = reward_lines(history)
        lines += ["## Outcome", "", *outcome, ""]
        notes = self._notes(train, evals, online=is_rl_log(history))
        if notes:
            lines += ["## Look at this", "", *[f"- {n}" for n in notes], ""]
        lines += ["## Plots", ""]
        if self.drawn_at_step is not None and self.drawn_at_step < state.global_step:
            share = f"{MAX_DRAWING_SHARE:.0%}"
            lines += [f"As of step {self.drawn_at_step} (redrawn when that costs under {share} of the run's time).", ""]
        method_plots = {name: plot.file for name, plot in method_plots_logged(train).items()}
        for key, name in {**PLOTS, **method_plots}.items():
            alt = key.replace("_", " ")
            drawn = self.drawn.get(name, "not drawn yet (at a later save, or at the end)")
            lines += [f"![{alt}]({name})" if drawn is True else f"*{alt}: no plot, {drawn}.*", ""]
        lines += ["## Data", "", *self._data_lines(), ""]
        lines += ["## Final metrics", "", *_metrics_table(train, evals, summary, cross_entropy), ""]
        lines += [
            "## Config",
            "",
            "<details><summary>The resolved config (every default filled in)</summary>",
            "",
            "```yaml",
            dump_config(cfg).rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
        return "\n".join(lines)

    def _status(self, state: Any, moment: str) -> str:
        written = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        step, total = state.global_step, state.max_steps
        if self.divergence is not None and self.divergence.step is not None:
            what = f"**Stopped: training diverged**. {self.divergence.message()}"
        elif moment == "save":
            what = f"**In progress**: written when `checkpoint-{step}` was saved, at step {step} of {total}"
        elif step >= total:
            what = f"**Finished**: step {step} of {total}"
        else:
            what = (
                f"**Stopped** at step {step} of {total}; `checkpoint-{step}` is saved. Run again with "
                "`auto_resume_from_checkpoints: true` to continue"
            )
        return f"{what} ({written})."

    def _run_lines(self) -> list[str]:
        cfg = self.cfg
        if cfg.adapter:
            targets = cfg.lora_target_modules or ("all linear layers" if cfg.lora_target_linear else "the defaults")
            targets = ", ".join(targets) if isinstance(targets, list) else targets
            if cfg.lora_target_parameters:  # expert weights of a mixture-of-experts model, adapted as parameters
                targets += f"; parameters: {', '.join(cfg.lora_target_parameters)}"
            name = {"lora": "LoRA", "qlora": "QLoRA (4-bit base)"}.get(cfg.adapter, cfg.adapter)
            name += " with DoRA" if cfg.peft_use_dora else ""
            method = f"{name} (r {cfg.lora_r}, alpha {cfg.lora_alpha}, targets: {targets})"
        else:
            method = "full fine-tuning"
        if cfg.rl in ONLINE_RL_METHODS and cfg.trl is not None:
            trl = cfg.trl
            loss = f", loss {trl.loss_type}" if trl.loss_type is not None else ""
            method = (
                f"{cfg.rl.upper()} (online reinforcement learning, {trl.num_generations} completions per prompt, "
                f"beta {trl.beta or 0:g}{loss}), {method}"
            )
        elif cfg.rl is not None:
            beta = f", rl_beta {cfg.rl_beta:g}" if cfg.rl_beta is not None else ""
            method = f"{cfg.rl.upper()} (preference tuning{beta}), {method}"
        if cfg.distills:
            teacher = f"teacher `{cfg.kd_teacher_model}` online" if cfg.kd_teacher_model else "stored teacher top-k"
            method = (
                f"knowledge distillation ({teacher}; kd_alpha {cfg.kd_alpha:g} x top-k divergence + kd_ce_alpha "
                f"{cfg.kd_ce_alpha:g} x cross-entropy, temperature {cfg.kd_temperature:g}), {method}"
            )
        sources = [e.path for e in cfg.datasets] + [e.path for e in cfg.pretraining_dataset]
        lines = [
            f"- Base model: `{cfg.base_model}`{' (vision-language)' if cfg.is_multimodal else ''}",
            f"- Method: {method}",
            f"- Data: {', '.join(f'`{s}`' for s in sources) or 'none'}",
            _batch_line(cfg),
            f"- Device: {_device_name()}",
        ]
        if self.parameters:
            trainable, total = self.parameters
            lines.append(
                f"- Trainable parameters: {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f} %)"
            )
        return lines

    def _outcome(self, train: list[dict], evals: list[dict], summary: dict | None, cross_entropy: bool) -> list[str]:
        lines = []
        train = [e for e in train if math.isfinite(e["loss"])]  # a NaN is no progress; `_notes` names its steps
        if train:
            first, last = train[0], train[-1]
            tail = [e["loss"] for e in train[-min(len(train), max(3, len(train) // 10)) :]]
            change = _change(first["loss"], _mean(tail))
            lines.append(
                f"- Training loss: {_num(first['loss'])} at step {first['step']}, {_num(last['loss'])} at step "
                f"{last['step']} (mean of the last {len(tail)} logged: {_num(_mean(tail))}{change})"
            )
            parts = [e for e in train if "kd_loss" in e]
            if parts:  # knowledge distillation: its two parts, each before its weight
                lines.append(
                    f"- Distillation: KD part {_num(parts[0]['kd_loss'])} -> {_num(parts[-1]['kd_loss'])}, "
                    f"cross-entropy part {_num(parts[0]['ce_loss'])} -> {_num(parts[-1]['ce_loss'])}"
                )
            aux = [e for e in train if "aux_loss" in e]
            if aux:  # a mixture-of-experts model's router load-balancing loss, part of the loss above
                lines.append(
                    f"- Router auxiliary loss (before its weight): {_num(aux[0]['aux_loss'])} at step {aux[0]['step']}, "
                    f"{_num(aux[-1]['aux_loss'])} at step {aux[-1]['step']}"
                )
        else:
            lines.append("- Training loss: nothing logged yet")
        if evals:
            last = evals[-1]
            best = min(evals, key=lambda e: e["eval_loss"])
            shown = f" (perplexity {_num(perplexity(last['eval_loss']))})" if cross_entropy else ""
            lines.append(
                f"- Evaluation loss: {_num(last['eval_loss'])} at step {last['step']}{shown}; lowest "
                f"{_num(best['eval_loss'])} at step {best['step']}"
            )
        else:
            lines.append("- Evaluation loss: no evaluation data (`val_set_size` or `test_datasets`)")
        counted = [e for e in train if "input_tokens" in e]
        if counted:
            speeds = [e["tokens_per_second"] for e in counted if e.get("tokens_per_second")]
            speed = f"; median {_num(median(speeds))} tokens/s" if speeds else ""
            lines.append(
                f"- Tokens (as of step {counted[-1]['step']}): {counted[-1]['input_tokens']:,} input, "
                f"{counted[-1]['trained_tokens']:,} trained{speed}"
            )
        if self.memory is not None and self.memory.samples:
            used_label, held_label = memory_labels()
            peak_used = max(s[1] for s in self.memory.samples)
            peak_held = max(s[2] for s in self.memory.samples)
            lines.append(f"- Peak memory: {_bytes(peak_used)} {used_label}, {_bytes(peak_held)} {held_label}")
        if self.started is not None:
            resumed = f", resumed at step {self.first_step}" if self.first_step else ""
            lines.append(f"- Wall time: {_duration(time.monotonic() - self.started)} of training in this run{resumed}")
        if summary is not None:
            lines.append(f"- Trainer's runtime: {_duration(summary['train_runtime'])}")
        return lines

    def _notes(self, train: list[dict], evals: list[dict], online: bool = False) -> list[str]:
        """What someone judging the run should not miss. `online`: an online RL run, judged by its rewards."""
        notes = []
        bad = [e["step"] for e in train if not math.isfinite(e["loss"])]
        if bad:
            notes.append(f"The training loss was not finite at step(s) {', '.join(map(str, bad[:10]))}.")
        finite = [e["loss"] for e in train if math.isfinite(e["loss"])]
        if online:
            notes += reward_notes(train)
        elif len(finite) >= 8:
            quarter = len(finite) // 4
            early, late = _mean(finite[:quarter]), _mean(finite[-quarter:])
            if late >= early:
                notes.append(
                    f"The training loss did not fall: {_num(early)} over the first quarter of the logs, {_num(late)} "
                    "over the last. Check the learning rate and the data."
                )
        if len(evals) >= 3 and not online:  # online RL's evaluation loss stays near 0 (its rewards are reported)
            best = min(evals, key=lambda e: e["eval_loss"])
            last = evals[-1]
            if last["step"] > best["step"] and last["eval_loss"] > 1.02 * best["eval_loss"]:
                notes.append(
                    f"The evaluation loss rose from {_num(best['eval_loss'])} at step {best['step']} to "
                    f"{_num(last['eval_loss'])} at step {last['step']}: the model may be overfitting; an earlier "
                    "checkpoint may be the better model (`hellbender evaluate --checkpoint DIR`)."
                )
        train_stats = (self.data_stats or {}).get("train")
        if train_stats and train_stats["rows_in"] and train_stats["rows_kept"] < train_stats["rows_in"]:
            dropped = train_stats["rows_in"] - train_stats["rows_kept"]
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(train_stats["rows_dropped"].items()))
            notes.append(
                f"{dropped} of {train_stats['rows_in']} training rows "
                f"({100 * dropped / train_stats['rows_in']:.1f} %) were dropped: {reasons}."
            )
        if self.memory is not None and self.memory.reported:
            notes.append("Memory grew steadily from step to step (see the memory watchdog's warning and the plot).")
        return notes

    def _data_lines(self) -> list[str]:
        stats = self.data_stats
        if not stats:
            return ["The training rows were streamed (or used as they are), so they were not counted in advance."]
        lines = [
            "| split | rows read | kept | dropped | tokens | trainable tokens |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        reasons = []
        for split in ("train", "eval"):
            s = stats.get(split)
            if not s:
                continue
            dropped = s["rows_in"] - s["rows_kept"]
            lines.append(
                f"| {split} | {s['rows_in']:,} | {s['rows_kept']:,} | {dropped:,} | {s['tokens']:,} | "
                f"{s['trainable_tokens']:,} |"
            )
            reasons += [f"- {split}: {n:,} dropped: {why}" for why, n in sorted(s["rows_dropped"].items())]
        lines += ["", *reasons] if reasons else ["", "No row was dropped."]
        held_out = f", {stats['eval_rows']:,} evaluation rows" if stats.get("eval_rows") else ""
        packed = f"; packed into {stats['packed_bins']:,} bins" if stats.get("packed_bins") is not None else ""
        lines += ["", f"Used: {stats['train_rows']:,} training rows{held_out}{packed}."]
        if stats.get("train") is None and stats.get("eval") is not None:
            lines.insert(0, "Only the evaluation rows were prepared; the training rows were streamed.\n")
        return lines


# -------------------------------------------------------------------------------------------------- writing


def write_report(directory: Path, page: str, plots: dict[str, bytes | str]) -> None:
    """Each plot drawn now (PNG bytes, or the reason it is missing), then the page that refers to them, each
    replaced atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(".*.tmp"):  # left by a run killed mid-write (another process id)
        if f".{os.getpid()}.tmp" not in stale.name:
            stale.unlink(missing_ok=True)
    for name, content in plots.items():
        if isinstance(content, bytes):
            write_file_atomically(directory / name, content)
        else:  # an older plot would no longer match the page
            (directory / name).unlink(missing_ok=True)
    write_file_atomically(directory / SUMMARY_NAME, page)


# -------------------------------------------------------------------------------------------------- helpers


def _metrics_table(train: list[dict], evals: list[dict], summary: dict | None, cross_entropy: bool) -> list[str]:
    values: dict[str, Any] = {}
    for entry in (train[-1] if train else None, evals[-1] if evals else None, summary):
        if entry:
            values.update({k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    if "eval_loss" in values and cross_entropy:
        values["eval_perplexity"] = perplexity(values["eval_loss"])
    if not values:
        return ["Nothing logged yet."]
    return ["| metric | value |", "|---|---:|", *[f"| {k} | {_num(v)} |" for k, v in values.items()]]


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores)"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _change(start: float, end: float) -> str:
    if not (math.isfinite(start) and math.isfinite(end)) or start == 0:
        return ""
    return f", {100 * (end - start) / abs(start):+.0f} %"


def _num(value: float | int) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        return f"{value:.3e}"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def _bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _numel(parameter: Any) -> int:
    """Elements of the whole parameter: under DeepSpeed ZeRO-3 the local tensor is an empty shard."""
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def _batch_line(cfg: Any) -> str:
    if cfg.rl in ONLINE_RL_METHODS and cfg.trl is not None:  # a micro-batch holds completions, not dataset rows
        return (
            f"- Batch: {cfg.micro_batch_size} completions x {cfg.gradient_accumulation_steps} accumulation steps "
            f"({cfg.trl.num_generations} per prompt); completions up to {cfg.trl.max_completion_length} tokens"
        )
    return (
        f"- Batch: {cfg.micro_batch_size} rows x {cfg.gradient_accumulation_steps} accumulation steps; "
        f"sequence length {cfg.sequence_len}{', packed' if cfg.sample_packing else ''}"
    )
