"""What the tracking keys ask of a whole config: SwanLab's cross-key checks and notices, and the run's name."""

from __future__ import annotations

from hellbender.config.plugins import SWANLAB_PLUGIN
from hellbender.config.schema import HellbenderConfig
from hellbender.config.tracking import SWANLAB_ENVIRONMENT, swanlab_asked


def swanlab_problems(cfg: HellbenderConfig) -> list[str]:
    problems = []
    asked = swanlab_asked(cfg.use_swanlab, cfg.swanlab_project, cfg.plugins)
    if asked and not cfg.swanlab_project:
        why = "`use_swanlab` is true" if cfg.use_swanlab else f"`plugins` lists `{SWANLAB_PLUGIN}`"
        problems.append(
            f"{why}, but `swanlab_project` is not set: SwanLab logs into a project. Add `swanlab_project: "
            "my-project`, or set `use_swanlab: false` (or remove the plugin) to log nothing to SwanLab."
        )
    names = (cfg.wandb_name, cfg.swanlab_experiment_name)
    if asked and all(names) and names[0] != names[1]:
        problems.append(
            f"`wandb_name: {names[0]}` and `swanlab_experiment_name: {names[1]}` name the run differently, but "
            "transformers gives every tracker the one `run_name`. Keep one of them (or give both the same name)."
        )
    return problems


def swanlab_notices(cfg: HellbenderConfig) -> list[str]:
    """`swanlab_*` keys beside `use_swanlab: false` ask for nothing."""
    keys = [k for k in (*SWANLAB_ENVIRONMENT, "swanlab_experiment_name") if getattr(cfg, k) is not None]
    if cfg.use_swanlab is False and keys:
        return [f"{', '.join(f'`{k}`' for k in keys)} set, but `use_swanlab: false`: nothing is logged to SwanLab."]
    return []


def run_name(cfg: HellbenderConfig) -> str | None:
    """The Trainer's `run_name`, which W&B and SwanLab both take as the run's name."""
    return cfg.wandb_name or (cfg.swanlab_experiment_name if cfg.use_swanlab else None)
