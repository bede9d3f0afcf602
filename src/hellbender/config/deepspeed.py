"""The `deepspeed:` JSON file, checked when the config is validated: its syntax, the ZeRO stage, values that must agree
with the hellbender config, and that the optional package is installed. `train/deepspeed.py` hands the checked path to
the Trainer, which fills in the `"auto"` values from its arguments.

Axolotl's configs name files of its checkout (`deepspeed_configs/zero2.json`); where such a file is not there,
hellbender uses its own preset of the same name (`hellbender/deepspeed_configs/`, same ZeRO stage, offload and
precision), and says so."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from hellbender.config.precision import precision_known_without_the_machine
from hellbender.config.preference import REFERENCE_METHODS
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.config.schema import HellbenderConfig
from hellbender.config.training_checks import COSINE_KEYS
from hellbender.errors import ConfigError

AUTO = "auto"
STAGES = (0, 1, 2, 3)
GATHER_ON_SAVE = "stage3_gather_16bit_weights_on_model_save"
GATHER_ON_SAVE_NEW_NAME = "gather_16bit_weights_on_model_save"  # DeepSpeed reads either spelling
PRESET_FOLDER = "deepspeed_configs"
# Axolotl presets hellbender does not ship: their `compile` block (`disable`, `backend`) is refused by current DeepSpeed
# (0.19.8 checked: its `compile` settings forbid unknown keys), and hellbender compiles with its own key.
COMPILE_PRESETS = {"zero1_torch_compile.json": "zero1.json", "zero2_torch_compile.json": "zero2.json"}


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def not_installed_message(name: str) -> str:
    return (
        f"`deepspeed: {name}` needs the `deepspeed` package, which is not installed. Install it with "
        "`pip install 'hellbender[deepspeed]'`, or remove `deepspeed:` (or pass `--set deepspeed=false`) to run "
        "without it."
    )


def deepspeed_problems(cfg: HellbenderConfig) -> list[str]:
    """Everything wrong with `deepspeed:` that is known without loading anything, one paragraph each. Run at
    validation, so that a run stops before it prepares data or loads a model."""
    if not cfg.deepspeed:
        return []
    try:
        settings = read_deepspeed_json(cfg.deepspeed)
    except ConfigError as exc:
        problems = [str(exc)]
    else:
        problems = settings_problems(cfg.deepspeed, settings)
        problems += contradictions(
            cfg, settings, *precision_known_without_the_machine(cfg), world=_launched_world_size()
        )
        problems += _replaced_choices(cfg, settings)
        problems += _quantized_base_problems(cfg, settings)
        problems += _preference_problems(cfg, settings)
        problems += _teacher_problems(cfg, settings)
        problems += _qat_problems(cfg, settings)
    return problems


def deepspeed_notices(cfg: HellbenderConfig) -> list[str]:
    """The package is a property of the machine, not of the config (which may be validated on a laptop and trained
    on a GPU server): validation says it is missing here, and `train` stops on it before any work."""
    if cfg.deepspeed and not deepspeed_installed():
        return [
            not_installed_message(cfg.deepspeed).replace(
                "is not installed.", "is not installed here; `train` needs it."
            )
        ]
    return []


def preset_dir() -> Path:
    return Path(__file__).resolve().parent.parent / PRESET_FOLDER


def preset_names() -> list[str]:
    return sorted(path.name for path in preset_dir().glob("*.json"))


def _names_a_preset_file(name: str) -> bool:
    """`zero2.json` or `<anything>/deepspeed_configs/zero2.json`: the file name alone, or in Axolotl's folder."""
    return Path(name).parent.name in ("", PRESET_FOLDER)


def preset_for(name: str) -> Path | None:
    """hellbender's preset standing in for `deepspeed: name`, or None: only for a path that does not exist, whose file
    name is a preset's, alone or inside a `deepspeed_configs` folder. A file that exists is always used as it is."""
    path = Path(name)
    if path.exists() or not _names_a_preset_file(name):
        return None
    preset = preset_dir() / path.name
    return preset if preset.is_file() else None


def use_deepspeed_preset(cfg: HellbenderConfig) -> tuple[HellbenderConfig, list[str]]:
    """The config with `deepspeed:` pointing at the preset that stands in for a missing Axolotl file, and the notice
    that says so (the resolved config then shows the preset's path)."""
    preset = preset_for(cfg.deepspeed) if cfg.deepspeed else None
    if preset is None:
        return cfg, []
    notice = (
        f"`deepspeed: {cfg.deepspeed}` does not exist here; using hellbender's preset of that name, {preset} "
        f"({describe_settings(json.loads(preset.read_text()))})."
    )
    return cfg.model_copy(update={"deepspeed": str(preset)}), [notice]


def describe_settings(settings: dict[str, Any]) -> str:
    """`ZeRO-3, parameters and optimizer states offloaded to CPU, bf16`: what a preset asks for, in words."""
    parts = [f"ZeRO-{zero_stage(settings)}"]
    offloaded = [
        what
        for key, what in (("offload_param", "parameters"), ("offload_optimizer", "optimizer states"))
        if isinstance(value_at(settings, f"zero_optimization.{key}"), dict)
    ]
    if offloaded:
        parts.append(f"{' and '.join(offloaded)} offloaded to CPU")
    parts.append("bf16" if value_at(settings, "bf16.enabled") is True else "precision from `bf16` / `fp16`")
    return ", ".join(parts)


def _missing_file_message(name: str, what: str) -> str:
    presets = ", ".join(f"`{PRESET_FOLDER}/{n}`" for n in preset_names())
    file_name = Path(name).name
    if file_name in COMPILE_PRESETS and _names_a_preset_file(name):
        return (
            f"`deepspeed: {name}`: {what}, and hellbender has no preset of that name: Axolotl's `{file_name}` sets a "
            "`compile` block (`disable`, `backend`) that current DeepSpeed releases refuse. Use "
            f"`deepspeed: {PRESET_FOLDER}/{COMPILE_PRESETS[file_name]}` and compile with `torch_compile: true`."
        )
    return (
        f"`deepspeed: {name}`: {what}. Point it at a DeepSpeed JSON config, or name one of hellbender's presets: "
        f"{presets}."
    )


def read_deepspeed_json(name: str) -> dict[str, Any]:
    """The DeepSpeed config as a dict. transformers reads it with `json.load`, so it must be strict JSON (no
    comments or trailing commas, which DeepSpeed's own hjson reader would allow)."""
    path = Path(name)
    if not path.is_file():
        raise ConfigError(_missing_file_message(name, "is a directory" if path.is_dir() else "no such file"))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"`deepspeed: {name}` is not UTF-8 text; a DeepSpeed config is a JSON file.") from None
    try:
        settings = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        line = text.splitlines()[exc.lineno - 1].strip() if text.strip() else ""
        shown = f": `{line}`" if line else ""
        raise ConfigError(
            f"`deepspeed: {name}` is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
            f"{shown}. DeepSpeed configs are strict JSON (double quotes, no comments, no trailing commas)."
        ) from None
    except _DuplicateKey as exc:
        raise ConfigError(
            f"`deepspeed: {name}`: `{exc.key}` is set twice in one JSON object; transformers would silently keep "
            "the last one. Keep one."
        ) from None
    if not isinstance(settings, dict):
        raise ConfigError(
            f"`deepspeed: {name}` holds a JSON {type(settings).__name__}; a DeepSpeed config is a JSON object "
            '(`{"zero_optimization": {"stage": 2}, ...}`).'
        )
    return settings


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _quantized_base_problems(cfg: HellbenderConfig, settings: dict[str, Any]) -> list[str]:
    """A bitsandbytes base trains under ZeRO-1 / ZeRO-2: each process keeps the whole quantized base on its GPU and
    DeepSpeed shards only the adapter's gradients and optimizer states. ZeRO-3 would partition the packed weights
    as they load, which is not built here."""
    if cfg.load_in_8bit:
        return ["`load_in_8bit` with `deepspeed` is not supported yet; use a bf16 base (`load_in_8bit: false`), or "
                "QLoRA (`adapter: qlora`) with ZeRO-1 or ZeRO-2."]  # fmt: skip
    if cfg.load_in_4bit and zero_stage(settings) == 3:
        return [
            f"QLoRA (`load_in_4bit`) with ZeRO-3 (`deepspeed: {cfg.deepspeed}`) is not supported yet: ZeRO-3 would "
            "partition the packed 4-bit weights as they load. Use ZeRO-2 (`deepspeed: deepspeed_configs/zero2.json`; "
            "each GPU holds the whole 4-bit base, which is small) or QLoRA with FSDP2 (`fsdp_version: 2`)."
        ]
    return []


def _preference_problems(cfg: HellbenderConfig, settings: dict[str, Any]) -> list[str]:
    """Preference tuning and online RL are verified with ZeRO-2 on two GPUs. Under ZeRO-3 the frozen reference copy
    of full fine-tuning is taken from weights already partitioned at load, and fails in its first forward; the other
    cases (an adapter's reference, generation inside each step) are not verified."""
    if not (cfg.rl or cfg.reward_model) or zero_stage(settings) != 3:
        return []
    method = f"`rl: {cfg.rl}`" if cfg.rl else "`reward_model: true`"
    if cfg.rl in ONLINE_RL_METHODS:
        why = "generating completions inside each step from weights ZeRO-3 partitions is not verified here"
    elif cfg.adapter is None and cfg.rl in REFERENCE_METHODS:
        why = "the reference model would be copied from weights ZeRO-3 has already partitioned"
    else:
        why = "it is not verified here"
    return [
        f"{method} with ZeRO-3 (`deepspeed: {cfg.deepspeed}`) is not supported yet: {why}. Use ZeRO-2 (`deepspeed: "
        "deepspeed_configs/zero2.json`) or FSDP2 (`fsdp_version: 2`), both verified with preference tuning and online "
        "RL on two GPUs."
    ]


def _qat_problems(cfg: HellbenderConfig, settings: dict[str, Any]) -> list[str]:
    """QAT swaps each linear layer for a fake-quantized one after loading; ZeRO-3 has by then partitioned the weights
    the new layers would take over (each process holds an empty slice)."""
    if cfg.qat is not None and zero_stage(settings) == 3:
        return [
            f"`qat:` with ZeRO-3 (`deepspeed: {cfg.deepspeed}`) is not supported yet: the fake-quantized layers would be "
            "built from weights ZeRO-3 has already partitioned as they loaded. Use ZeRO-2 (`deepspeed: "
            "deepspeed_configs/zero2.json`) or FSDP2 (`fsdp_version: 2`)."
        ]
    return []


def _teacher_problems(cfg: HellbenderConfig, settings: dict[str, Any]) -> list[str]:
    """An online distillation teacher is loaded while ZeRO-3's loading context is active, which would partition its
    weights too, with no engine to gather them for its forward passes."""
    if cfg.kd_teacher_model and zero_stage(settings) == 3:
        return [
            f"`kd_teacher_model` with ZeRO-3 (`deepspeed: {cfg.deepspeed}`) is not supported yet: ZeRO-3 would "
            "partition the teacher's weights as they load, and nothing gathers them for its forward passes. Use "
            "ZeRO-2 (`deepspeed: deepspeed_configs/zero2.json`), or write the teacher's targets into the data with "
            "`hellbender distill-logprobs` and train without `kd_teacher_model`."
        ]
    return []


def zero_stage(settings: dict[str, Any]) -> int | None:
    zero = settings.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) and stage in STAGES else None


def settings_problems(name: str, settings: dict[str, Any]) -> list[str]:
    """The ZeRO stage, and settings without which the run would not give a model that transformers loads."""
    zero = settings.get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        return [
            f"`deepspeed: {name}` has no `zero_optimization.stage`. Add it, e.g. "
            '`"zero_optimization": {"stage": 2}` (2 shards optimizer states and gradients over the processes, 3 also '
            "the weights)."
        ]
    problems = []
    stage = zero_stage(settings)
    if stage is None:
        problems.append(
            f"`deepspeed: {name}`: `zero_optimization.stage` is {json.dumps(zero['stage'])}; it must be 0, 1, 2 or 3 "
            "(a number, not `auto`)."
        )
    if stage == 3 and zero.get(GATHER_ON_SAVE) is not True and zero.get(GATHER_ON_SAVE_NEW_NAME) is not True:
        problems.append(
            f'`deepspeed: {name}`: ZeRO-3 needs `"{GATHER_ON_SAVE}": true` in `zero_optimization`. Without it the '
            "Trainer saves only DeepSpeed's sharded checkpoint, which transformers and PEFT cannot load."
        )
    if "bfloat16" in settings:
        problems.append(
            f"`deepspeed: {name}`: `bfloat16` is DeepSpeed's old name for `bf16`, which transformers neither fills "
            "in nor checks against the hellbender config. Rename it to `bf16`."
        )
    return problems


def _launched_world_size() -> int | None:
    """The number of processes, known only inside launched processes: `hellbender train --nproc N` validates the
    config once before it starts them."""
    return int(os.environ["WORLD_SIZE"]) if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def value_at(settings: dict[str, Any], dotted: str) -> Any:
    node: Any = settings
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, str)) or value is None else str(value)


def contradictions(
    cfg: HellbenderConfig, settings: dict[str, Any], bf16: bool | None, fp16: bool | None, world: int | None
) -> list[str]:
    """Values in the DeepSpeed config that are not `"auto"` and differ from what the Trainer gets from the hellbender
    config. transformers fills `"auto"` from the same values and refuses a mismatch itself, but only once the model is
    loaded; this says it up front, naming both keys. `bf16` / `fp16` / `world` are None where not known yet."""
    batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    pairs: list[tuple[str, str, Any]] = [
        ("train_micro_batch_size_per_gpu", f"`micro_batch_size: {cfg.micro_batch_size}`", cfg.micro_batch_size),
        (
            "gradient_accumulation_steps",
            f"`gradient_accumulation_steps: {cfg.gradient_accumulation_steps}`",
            cfg.gradient_accumulation_steps,
        ),
        ("gradient_clipping", f"`max_grad_norm: {cfg.max_grad_norm}`", cfg.max_grad_norm),
        ("optimizer.params.lr", f"`learning_rate: {cfg.learning_rate}`", cfg.learning_rate),
        ("optimizer.params.weight_decay", f"`weight_decay: {cfg.weight_decay}`", cfg.weight_decay),
        ("scheduler.params.warmup_max_lr", f"`learning_rate: {cfg.learning_rate}`", cfg.learning_rate),
    ]
    if bf16 is not None:
        pairs.append(("bf16.enabled", _precision_text(cfg, "bf16", bf16), bf16))
    if fp16 is not None:
        pairs.append(("fp16.enabled", _precision_text(cfg, "fp16", fp16), fp16))
    if world is not None:
        pairs.append(
            (
                "train_batch_size",
                f"`micro_batch_size` x `gradient_accumulation_steps` x {world} processes = {batch * world}",
                batch * world,
            )
        )
    problems = []
    for ds_key, hellbender_text, expected in pairs:
        value = value_at(settings, ds_key)
        if value is None or value in (AUTO, expected):
            continue
        problems.append(
            f"`deepspeed: {cfg.deepspeed}`: `{ds_key}` is {_shown(value)} there, but the hellbender config has "
            f"{hellbender_text}. Write `{_auto_json(ds_key)}` in the DeepSpeed config (transformers then fills in the "
            "hellbender value), or make the two agree."
        )
    total = value_at(settings, "train_batch_size")
    if world is None and isinstance(total, int) and total % batch:
        problems.append(
            f"`deepspeed: {cfg.deepspeed}`: `train_batch_size` is {total}, which is not `micro_batch_size` x "
            f"`gradient_accumulation_steps` ({batch}) times a number of processes. Write "
            '`"train_batch_size": "auto"` in the DeepSpeed config (transformers fills it in).'
        )
    return problems


def _auto_json(dotted: str) -> str:
    """`a.b` -> `"a": {"b": "auto"}`: what to write in the DeepSpeed config."""
    *parents, leaf = dotted.split(".")
    text = f'"{leaf}": "auto"'
    for part in reversed(parents):
        text = f'"{part}": {{{text}}}'
    return text


def _precision_text(cfg: HellbenderConfig, key: str, on: bool) -> str:
    literal = getattr(cfg, key)
    setting = f"`{key}: {str(literal).lower()}`"
    if literal is on:
        return setting
    return f"{setting} with `bf16: auto`, which turns {key} {'on' if on else 'off'} on this machine"


def _replaced_choices(cfg: HellbenderConfig, settings: dict[str, Any]) -> list[str]:
    """An `optimizer` or `scheduler` block in the DeepSpeed config replaces the Trainer's; it cannot also honour a
    choice the hellbender config makes explicitly."""
    problems = []
    chosen = cfg.model_fields_set
    if "optimizer" in settings and "optimizer" in chosen and cfg.optimizer != "auto":
        problems.append(
            f"`deepspeed: {cfg.deepspeed}` has an `optimizer` block, which replaces hellbender's `optimizer: "
            f"{cfg.optimizer}`. Remove one of them."
        )
    schedule = ("lr_scheduler", "warmup_steps", "warmup_ratio", *COSINE_KEYS)
    scheduler_keys = [k for k in schedule if k in chosen and getattr(cfg, k) is not False]
    if "scheduler" in settings and scheduler_keys:
        keys = ", ".join(f"`{k}`" for k in scheduler_keys)
        problems.append(
            f"`deepspeed: {cfg.deepspeed}` has a `scheduler` block, which replaces the schedule set by {keys}. "
            "Remove the block, or those keys."
        )
    return problems
