"""Which run an `output_dir` and its checkpoints belong to, so that two runs never mix their outputs.

A run is identified by a run id, drawn when a run starts from scratch and inherited when it resumes, and by its
defining keys (`DEFINING_KEYS`): the base model and what is trained on it (adapter kind and shape, added tokens,
quantization, trainable parameters, optimizer) and the data whose position the step counter stands for. Every
checkpoint and final-model manifest records both (`storage.write_manifest(run=...)`), and `output_dir/hellbender_run.json`
names the run that owns the directory now.

The rules (`claim_output_dir`, checked before any work):
- a resumed run continues the run of its checkpoint: the defining keys must be the ones it was trained with (other
  keys, such as `max_steps`, `learning_rate` or `save_steps`, may change when resuming);
- a run writes only into an `output_dir` that holds no complete checkpoint or final model of another run (another
  run id): starting anew where a run left outputs would overwrite `checkpoint-N` one by one and mix the two;
- a run that finds the directory taken over by another run at a save stops (`OutputDirTakenOver`), writing nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, UserError
from hellbender.storage import (
    CHECKPOINT_MANIFEST,
    FINAL_MANIFEST,
    checkpoint_dirs,
    incompleteness,
    manifest_run,
    read_manifest,
    write_file_atomically,
)

logger = logging.getLogger("hellbender")
RUN_FILE = "hellbender_run.json"

# Keys whose change makes a checkpoint another run's: they decide which weights exist and what they are (loading
# would fail or silently train another model), or which rows the saved step counter and data position refer to.
DEFINING_KEYS = (
    "base_model",
    "revision_of_model",
    "model_type",
    "overrides_of_model_config",
    "tokenizer_config",
    "tokens",
    "special_tokens",
    "resize_token_embeddings_to_32x",
    "reinit_weights",
    "load_in_4bit",
    "load_in_8bit",
    "model_quantization_config",
    "model_quantization_config_kwargs",
    "adapter",
    "peft",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "lora_target_linear",
    "lora_target_parameters",
    "lora_modules_to_save",
    "peft_use_dora",
    "peft_use_rslora",
    "unfrozen_parameters",
    "freeze_mm_modules",
    "optimizer",
    "datasets",
    "pretraining_dataset",
)


class OutputDirTakenOver(UserError):
    """Another run claimed this run's `output_dir` while it trained."""


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    defines: dict[str, Any] = field(compare=False)
    started: str = field(compare=False, default="")

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.defines)

    def record(self) -> dict[str, Any]:
        """What manifests and the run file store."""
        return {
            "run_id": self.run_id,
            "fingerprint": self.fingerprint,
            "started": self.started,
            "defines": self.defines,
        }


def defining_values(cfg: HellbenderConfig) -> dict[str, Any]:
    resolved = cfg.model_dump(mode="json")
    return {key: resolved.get(key) for key in DEFINING_KEYS}


def fingerprint(defines: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(defines, sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_identity(cfg: HellbenderConfig, run_id: str | None = None) -> RunIdentity:
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return RunIdentity(run_id or uuid.uuid4().hex[:12], defining_values(cfg), started)


def differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """`key: theirs` -> `key: ours` for each defining key that differs (keys the older record lacks are skipped)."""
    found = []
    for key in DEFINING_KEYS:
        if key in theirs and theirs[key] != ours.get(key):
            found.append(f"`{key}: {_short(theirs[key])}` there, `{key}: {_short(ours.get(key))}` here")
    return found


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def check_resume_identity(cfg: HellbenderConfig, checkpoint: Path, key: str) -> str | None:
    """The run id that resuming from `checkpoint` continues (None for a checkpoint written before runs had one);
    refuses a checkpoint of another run (other defining keys) with one paragraph naming the keys."""
    theirs = manifest_run(checkpoint)
    if theirs is None:
        _check_adapter_shape(cfg, checkpoint, key)
        logger.warning(
            "%s was written by an earlier hellbender without content hashes or a run identity: its files and the run "
            "it belongs to cannot be verified.",
            checkpoint,
        )
        return None
    changed = differences(theirs.get("defines") or {}, defining_values(cfg))
    if changed:
        which = (
            f"`{checkpoint}`"
            if key == "resume_from_checkpoint"
            else f"the newest checkpoint of `output_dir`, `{checkpoint}`,"
        )
        raise ConfigError(
            f"`{key}`: {which} belongs to another run (run {theirs['run_id']}): it was trained with "
            f"{'; '.join(changed)}. These keys define the run (the weights it trains and the data its steps count), so "
            "the checkpoint cannot continue under this config. Put them back to resume it, or start a new run with "
            "another `output_dir`."
        )
    return theirs["run_id"]


def _check_adapter_shape(cfg: HellbenderConfig, checkpoint: Path, key: str) -> None:
    """For a checkpoint without a run identity: the adapter it holds must be the one this config builds."""
    try:
        saved = json.loads((checkpoint / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        saved = None
    if (saved is not None) != bool(cfg.adapter):
        held = "a LoRA adapter" if saved is not None else "a whole model (no adapter)"
        wanted = f"`adapter: {cfg.adapter}`" if cfg.adapter else "a full fine-tune (no `adapter`)"
        raise ConfigError(
            f"`{key}`: `{checkpoint}` holds {held}, but this config trains {wanted}: it belongs to another run. "
            "Resume it with the config it was trained with, or start a new run with another `output_dir`."
        )
    if saved is not None and saved.get("r") is not None and saved.get("r") != cfg.lora_r:
        raise ConfigError(
            f"`{key}`: `{checkpoint}` holds a LoRA adapter of rank {saved['r']}, but this config says "
            f"`lora_r: {cfg.lora_r}`: it belongs to another run. Set `lora_r: {saved['r']}` to resume it, or start a "
            "new run with another `output_dir`."
        )


def outputs_of_other_runs(output_dir: Path, run_id: str | None) -> list[str]:
    """Names of the complete checkpoints and final model in `output_dir` that another run wrote. With `run_id`
    None (resuming a checkpoint that predates run identities), outputs without an identity count as this run's."""
    found = []
    for _, path in checkpoint_dirs(output_dir):
        if incompleteness(path) is None and _other(manifest_run(path), run_id):
            found.append(path.name)
    if read_manifest(output_dir, FINAL_MANIFEST) is not None and _other(
        manifest_run(output_dir, FINAL_MANIFEST), run_id
    ):
        found.append(f"the final model ({FINAL_MANIFEST})")
    return found


def _other(run: dict[str, Any] | None, run_id: str | None) -> bool:
    if run is None:
        return run_id is not None
    return run["run_id"] != run_id


def claim_output_dir(cfg: HellbenderConfig, resume_from: Path | None, key: str | None) -> RunIdentity:
    """This run's identity, once `output_dir` is known to hold no other run's outputs (nothing is written: a run
    that fails before training leaves no trace; `record_owner` writes the run file when training starts). `key`: the
    config key that chose `resume_from`."""
    output_dir = Path(cfg.output_dir)
    inherited = check_resume_identity(cfg, resume_from, key or "resume_from_checkpoint") if resume_from else None
    identity = new_identity(cfg, inherited)
    others = outputs_of_other_runs(output_dir, inherited if resume_from else identity.run_id)
    if others:
        raise ConfigError(_foreign_outputs_message(cfg, output_dir, others, resuming=resume_from is not None))
    return identity


def record_owner(output_dir: Path, identity: RunIdentity) -> None:
    """Name this run as the owner of `output_dir` (in the run file), right before it trains and saves there."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_file_atomically(output_dir / RUN_FILE, json.dumps(identity.record(), indent=1))


def _foreign_outputs_message(cfg: HellbenderConfig, output_dir: Path, others: list[str], resuming: bool) -> str:
    shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
    earlier = _recorded_defines(output_dir, others)
    changed = differences(earlier, defining_values(cfg)) if earlier is not None else []
    what = "This run resumes another run's checkpoint" if resuming else "This run starts from scratch"
    advice = ""
    if changed:
        advice = f"That run was trained with {'; '.join(changed)}."
    elif earlier is not None and not resuming:
        advice = (
            "It has the same defining keys: to continue it from its newest checkpoint, set "
            "`auto_resume_from_checkpoints: true` (other keys, such as `max_steps`, may change)."
            if not cfg.auto_resume_from_checkpoints
            else "It has the same defining keys but no complete checkpoint to continue from."
        )
    return (
        f"`output_dir: {output_dir}` holds outputs of another run: {shown}. {what}, and writing into the same "
        f"directory would overwrite them checkpoint by checkpoint and mix the two runs. {advice} Give this run another "
        "`output_dir`, or move or delete those outputs first."
    ).replace("  ", " ")


def _recorded_defines(output_dir: Path, others: list[str]) -> dict[str, Any] | None:
    for name in others:
        directory, manifest = (
            (output_dir, FINAL_MANIFEST) if name.startswith("the final") else (output_dir / name, CHECKPOINT_MANIFEST)
        )
        run = manifest_run(directory, manifest)
        if run is not None:
            return run.get("defines") or {}
    return None


def check_still_owner(output_dir: Path, identity: RunIdentity) -> None:
    """Before each save: stop if another run has claimed `output_dir` since this one started."""
    try:
        owner = json.loads((output_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        owner = None
    if owner != identity.run_id:
        raise OutputDirTakenOver(
            f"`output_dir: {output_dir}` was claimed by another run ({owner or 'its run file is gone'}) while this "
            f"run ({identity.run_id}) trained. This run stopped without writing anything more, so the two never mix. "
            "Give each run its own `output_dir`."
        )
