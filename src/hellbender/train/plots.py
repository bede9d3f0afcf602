"""The run report's plots (loss, learning rate, tokens/s and memory per optimizer step, and the training method's
own metrics: preference tuning's rewards, online RL's rewards and completion lengths), drawn with matplotlib's
Agg canvas: no display, and no pyplot global state, so plotting from a training callback neither needs a screen
nor touches the figures of the program around it."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

# Plot -> its file in the report directory.
PLOTS = {
    "loss": "loss.png",
    "learning_rate": "learning_rate.png",
    "tokens_per_second": "tokens_per_second.png",
    "memory": "memory.png",
}


@dataclass(frozen=True)
class MetricsPlot:
    """A plot of logged metrics, drawn when the run logs any of them. `series`: (label, logged key)."""

    file: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]


# The metrics of preference tuning and reward models, each plotted when the run's method logs it: the implicit rewards
# of DPO, KTO, ORPO and SimPO (`rewards/*`), a reward model's margin and ranking accuracy, KTO's KL estimate, and the
# likelihood and odds-ratio terms of ORPO and SimPO.
PREFERENCE_PLOTS = {
    "rewards": MetricsPlot(
        "rewards.png",
        "Rewards",
        "reward (implicit: beta x log-ratio; a reward model's score)",
        (
            ("chosen", "rewards/chosen"),
            ("rejected", "rewards/rejected"),
            ("margin", "rewards/margins"),
            ("margin (reward model)", "margin"),
        ),
    ),
    "preference_accuracy": MetricsPlot(
        "preference_accuracy.png",
        "Preference accuracy",
        "pairs whose chosen reward is higher",
        (("accuracy", "rewards/accuracies"), ("accuracy (reward model)", "accuracy")),
    ),
    "kl": MetricsPlot("kl.png", "KL estimate (KTO)", "KL(policy || reference)", (("KL", "kl"),)),
    "preference_terms": MetricsPlot(
        "preference_terms.png",
        "Loss terms",
        "value per batch",
        (("NLL of the chosen answer", "nll_loss"), ("log odds ratio", "log_odds_ratio")),
    ),
}


def preference_plots_logged(train: list[dict[str, Any]]) -> dict[str, MetricsPlot]:
    """The preference plots whose metrics the run has logged."""
    logged = {key for entry in train for key in entry}
    return {name: plot for name, plot in PREFERENCE_PLOTS.items() if any(key in logged for _, key in plot.series)}


# What online RL (GRPO, RLOO) logs per step: TRL's total reward, each reward function's under `rewards/<name>/...`.
ONLINE_REWARD = "reward"
_FUNCTION_PREFIX = "rewards/"


def online_rl_plots_logged(train: list[dict[str, Any]]) -> dict[str, MetricsPlot]:
    """The plots of an online RL run (GRPO, RLOO): its rewards, their spread, the completions' lengths, and the KL
    to the reference where `beta > 0` logs it. Its loss is no progress measure (the advantages of a group sum to
    about zero), so these are what show whether it learns."""
    logged = {key for entry in train for key in entry}
    functions = sorted(
        key[len(_FUNCTION_PREFIX) : -len("/mean")]
        for key in logged
        if key.startswith(_FUNCTION_PREFIX) and key.endswith("/mean")
    )
    plots = {
        "reward": MetricsPlot(
            "reward.png",
            "Reward of the generated completions",
            "mean reward per step",
            (("total (weighted sum)", ONLINE_REWARD), *((name, f"rewards/{name}/mean") for name in functions)),
        ),
        "reward_std": MetricsPlot(
            "reward_std.png",
            "Reward spread",
            "standard deviation of the rewards",
            (("total", "reward_std"), *((name, f"rewards/{name}/std") for name in functions)),
        ),
        "completion_length": MetricsPlot(
            "completion_length.png",
            "Completion length",
            "tokens per completion",
            (
                ("mean", "completions/mean_length"),
                ("min", "completions/min_length"),
                ("max", "completions/max_length"),
            ),
        ),
        "kl": MetricsPlot("kl.png", "KL to the reference", "KL(policy || reference) per token", (("KL", "kl"),)),
    }
    return {name: plot for name, plot in plots.items() if any(key in logged for _, key in plot.series)}


# Knowledge distillation's two loss parts (`train/distillation.py`), each before its weight.
DISTILLATION_PLOTS = {
    "distillation_loss": MetricsPlot(
        "distillation_loss.png",
        "Distillation loss parts",
        "per trained token (before kd_alpha / kd_ce_alpha)",
        (("KD: divergence from the teacher's top-k", "kd_loss"), ("cross-entropy on the data", "ce_loss")),
    )
}


def method_plots_logged(train: list[dict[str, Any]]) -> dict[str, MetricsPlot]:
    """The plots of the training method's own metrics: online RL's when the run logs rewards of generated
    completions, distillation's when it logs its loss parts, else preference tuning's (KTO's `kl` and GRPO's share
    a name, not a meaning)."""
    if any(ONLINE_REWARD in entry for entry in train):
        return online_rl_plots_logged(train)
    if any("kd_loss" in entry for entry in train):
        return DISTILLATION_PLOTS
    return preference_plots_logged(train)


GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Series:
    label: str
    steps: list[float]
    values: list[float]
    points: bool = False  # markers only (sparse values such as evaluations), not a line


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def line_plot(series: list[Series], title: str, ylabel: str, log_y: bool = False) -> bytes:
    """A PNG of `series` against the optimizer step, with title, axis labels, grid and a legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # Fixed margins: an automatic layout doubles the drawing time, and the report is drawn at every save.
    figure = Figure(figsize=(7, 3.6), dpi=100)
    figure.subplots_adjust(left=0.11, right=0.98, bottom=0.14, top=0.9)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    series = [_finite(s) for s in series]  # a NaN or inf is no point on a progress curve (the report names it)
    for s in series:
        few = len(s.steps) < 30
        if s.points:
            axes.plot(s.steps, s.values, "o", label=s.label, markersize=5)
        else:
            axes.plot(s.steps, s.values, "-", marker="." if few else None, label=s.label, linewidth=1.4)
    axes.set_title(title)
    axes.set_xlabel("optimizer step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(ylabel)
    if log_y and all(v > 0 for s in series for v in s.values):
        axes.set_yscale("log")
    else:  # short tick labels that fit the margin: 1.2e6 tokens/s as 1.2 with "1e6" above the axis
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 5), useOffset=False)
    axes.grid(True, alpha=0.3)
    if len(series) > 1:
        axes.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _finite(series: Series) -> Series:
    kept = [(x, y) for x, y in zip(series.steps, series.values, strict=True) if math.isfinite(y)]
    return Series(series.label, [x for x, _ in kept], [y for _, y in kept], series.points)


def train_logs(history: list[dict]) -> list[dict]:
    """The Trainer's training log entries (not evaluations, not the final summary)."""
    return [e for e in history if "loss" in e and "step" in e]


def memory_labels() -> tuple[str, str]:
    """What the memory watchdog's two numbers are on this machine."""
    import torch

    if torch.cuda.is_available():
        return "allocated (GPU)", "reserved by the allocator (GPU)"
    return "in use (malloc, CPU)", "resident (CPU)"


def report_plots(history: list[dict], memory: list[tuple[int, int, int]] | str) -> dict[str, bytes | str]:
    """File name -> PNG bytes, or the reason there is no plot. `history` is the Trainer's log history; `memory`
    the watchdog's (step, bytes in use, bytes held) samples, or why there are none."""
    if not plotting_available():
        return dict.fromkeys(PLOTS.values(), "matplotlib is not installed (`pip install matplotlib`)")
    train = train_logs(history)
    evals = [e for e in history if "eval_loss" in e]
    loss = [_series("training", train, "loss")]
    if evals:
        loss.append(_series("evaluation", evals, "eval_loss", points=True))
    online = any(ONLINE_REWARD in entry for entry in train)
    loss_label = (
        "policy loss (about 0 by construction; see the reward)" if online else "cross-entropy per trained token"
    )
    return {
        PLOTS["loss"]: _plot_or_reason(loss, "Loss", loss_label),
        PLOTS["learning_rate"]: _plot_or_reason(
            [_series("learning rate", train, "learning_rate")], "Learning rate", "learning rate"
        ),
        PLOTS["tokens_per_second"]: _plot_or_reason(
            [_series("tokens/s", train, "tokens_per_second")], "Throughput", "input tokens per second"
        ),
        PLOTS["memory"]: _memory_plot(memory),
        **_method_plots(train),
    }


def _method_plots(train: list[dict]) -> dict[str, bytes | str]:
    return {
        plot.file: _plot_or_reason([_series(label, train, key) for label, key in plot.series], plot.title, plot.ylabel)
        for plot in method_plots_logged(train).values()
    }


def _series(label: str, logs: list[dict[str, Any]], key: str, points: bool = False) -> Series:
    rows = [e for e in logs if e.get(key) is not None]
    return Series(label, [float(e["step"]) for e in rows], [float(e[key]) for e in rows], points)


def _plot_or_reason(series: list[Series], title: str, ylabel: str) -> bytes | str:
    series = [s for s in series if s.steps]
    return line_plot(series, title, ylabel) if series else "nothing logged yet"


def _memory_plot(samples: list[tuple[int, int, int]] | str) -> bytes | str:
    if isinstance(samples, str):
        return samples
    if not samples:
        return "no step has finished yet"
    used_label, held_label = memory_labels()
    unit, scale = ("GiB", GIB) if max(s[2] for s in samples) >= GIB else ("MiB", MIB)
    steps = [float(s[0]) for s in samples]
    used = Series(used_label, steps, [s[1] / scale for s in samples])
    held = Series(held_label, steps, [s[2] / scale for s in samples])
    return line_plot([used, held], "Memory after each step", unit)
