"""Helpers shared by the test modules and by the processes some tests start (`python -m tests.<module>`)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from tests.conftest import EXAMPLES, REPO

CHAT_DATA = str(EXAMPLES / "data" / "chat.jsonl")
PREFERENCE_DATA = str(EXAMPLES / "data" / "preference.jsonl")
TEXT_DATA = str(EXAMPLES / "data" / "text.jsonl")
SHAPES_DATA = EXAMPLES / "data" / "shapes.jsonl"  # coloured squares, image chat rows


# --- configs and what a run leaves behind ---------------------------------------------------------------------


def base_config(tmp_path: Path, **overrides) -> dict:
    """A short fp32 run of the tiny Llama on the bundled chat data, logging every step."""
    cfg = {
        "base_model": "hellbender/tiny-llama",
        "datasets": [{"path": CHAT_DATA, "type": "chat_template"}],
        "sequence_len": 128,
        "micro_batch_size": 4,
        "max_steps": 6,
        "learning_rate": 3e-3,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "bf16": False,
        "output_dir": str(tmp_path / "out"),
        "dataset_prepared_path": str(tmp_path / "prepared"),
    }
    cfg.update(overrides)
    return cfg


def vlm_config(tmp_path: Path, base_model: str, **overrides) -> dict:
    """`base_config` for a vision-language model on the bundled coloured-squares chat data."""
    defaults = dict(
        base_model=base_model,
        processor_type="AutoProcessor",
        datasets=[{"path": str(SHAPES_DATA), "type": "chat_template"}],
        sequence_len=256,
        max_steps=3,
        learning_rate=1e-3,
    )
    return base_config(tmp_path, **{**defaults, **overrides})


def trainer_state(output_dir: str | Path) -> dict:
    return json.loads((Path(output_dir) / "trainer_state.json").read_text())


def logged_losses(output_dir: str | Path) -> dict[int, float]:
    """step -> the training loss logged at that step."""
    return {e["step"]: e["loss"] for e in trainer_state(output_dir)["log_history"] if "loss" in e}


def final_weights(output_dir: str | Path) -> dict:
    """The saved adapter's tensors, or the full model's when no adapter was saved."""
    from safetensors.torch import load_file

    out = Path(output_dir)
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(out / name)


# --- training callbacks ----------------------------------------------------------------------------------------


class StopAt(TrainerCallback):
    """Stops training once `step` optimizer steps are done, as an interrupted run stops (checkpoints already saved
    stay; nothing else is written)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class StepSnapshot:
    """Records parameters before the first optimizer step and after it."""

    def __init__(self):
        outer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                outer.before = {n: p.detach().clone() for n, p in model.named_parameters()}
                outer.trainable = {n for n, p in model.named_parameters() if p.requires_grad}

            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step == 1:
                    outer.after = {n: p.detach().clone() for n, p in model.named_parameters()}

        self.callback = Callback()


def record_training(patch) -> dict:
    """Record, in this process, every image file read (header checks, decoding by the encoder or the collator), the
    images of each streamed row collated, and the stream rows and token ids of each micro-batch trained on. `patch`
    is `setattr` or `monkeypatch.setattr`. The files read come from the DEBUG records hellbender's image reader logs
    (`hellbender.data.images`), so every read is seen, whichever module asked for it."""
    import logging

    import hellbender.data.images as images_module
    from hellbender.data.multimodal_collator import MultimodalCollator
    from hellbender.data.streaming import STREAM_ROW_KEY
    from hellbender.train.trainer import HellbenderTrainer

    record: dict = {"opened": [], "images_of_row": {}, "trained": []}

    class Reads(logging.Handler):
        def emit(self, log: logging.LogRecord) -> None:
            record["opened"].append(str(log.args[0]))

    reads = images_module.logger
    patch(reads, "handlers", [Reads()])
    patch(reads, "propagate", False)  # recorded, not printed
    patch(reads, "level", logging.DEBUG)
    reads.setLevel(logging.DEBUG)  # also clears the logging module's cache of which levels are enabled
    collate = MultimodalCollator.__call__

    def collating(self, rows):
        for row in rows:
            record["images_of_row"][str(row[STREAM_ROW_KEY])] = list(row["images"])
        return collate(self, rows)

    compute_loss = HellbenderTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        if model.training:
            record["trained"].append([inputs[STREAM_ROW_KEY].tolist(), inputs["input_ids"].tolist()])
        return compute_loss(self, model, inputs, *args, **kwargs)

    patch(MultimodalCollator, "__call__", collating)
    patch(HellbenderTrainer, "compute_loss", recording)
    return record


# --- the command line ------------------------------------------------------------------------------------------


def cli_train(tmp_path: Path, cfg: dict, name: str = "config.yml") -> Path:
    """`hellbender train` on `cfg` written to tmp_path/name, in this process; it must succeed."""
    import yaml

    config = tmp_path / name
    config.write_text(yaml.safe_dump(cfg))
    result = invoke("train", config)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return config


def invoke(*args, env: dict[str, str] | None = None):
    """The `hellbender` command in this process (typer's CliRunner): the result has exit_code, output, stderr."""
    from typer.testing import CliRunner

    from hellbender.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def assert_user_error(result, *needles: str) -> None:
    """Exit code 2, an `error:` paragraph on stderr naming each needle, and no traceback."""
    detail = f"exit {result.exit_code}, exception {result.exception!r}\n{result.output}"
    assert result.exit_code == 2, detail
    assert isinstance(result.exception, SystemExit), detail  # not an exception that escaped the CLI
    assert "Traceback" not in result.output, detail
    assert "error:" in result.stderr, detail
    for needle in needles:
        assert needle in result.output, f"{needle!r} not in output:\n{result.output}"


def preference_trainer(cfg, train_rows, eval_rows=None, callbacks=()):
    """The trainer `hellbender train` builds for a preference config (`rl` or `reward_model`), on the given prepared
    rows, with the model its config builds."""
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.models.stack import build_trainable_model
    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods import preference_method
    from hellbender.train.schedule import plan_schedule
    from hellbender.train.tokens import TokenCounter

    method = preference_method(cfg)
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    model = build_trainable_model(cfg, tokenizer)
    schedule = plan_schedule(cfg, len(train_rows), 1)
    args = training_arguments(cfg, schedule, eval_rows is not None, False, *method.arguments(cfg))
    return method.build_trainer(
        cfg, model, args, train_rows, eval_rows, tokenizer, callbacks=[TokenCounter(), *callbacks]
    )


def model_survey():
    """scripts/model_survey.py as a module (it is a script, not a package), loaded once per test process."""
    import importlib.util
    import sys

    if "model_survey" not in sys.modules:
        spec = importlib.util.spec_from_file_location("model_survey", REPO / "scripts" / "model_survey.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_survey"] = module
        spec.loader.exec_module(module)
    return sys.modules["model_survey"]


def assert_two_lora_steps_learn(model, loss) -> None:
    """Two AdamW steps of `model`'s trainable weights on `loss()` (one fixed batch): finite losses, a lower loss after
    them (both measured in eval mode), and every trainable weight changed except exactly those of the modules the
    first backward did not reach, as hellbender's run names them (train/unused_weights.py). No weight decay, so a
    weight changes only where a gradient moves it."""
    import torch

    from hellbender.train.unused_weights import unused_modules, weights_without_gradient

    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert before, "no trainable weights"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    with torch.no_grad():
        first = loss(model.eval())
    unreached = None
    for _ in range(2):
        step_loss = loss(model.train())
        assert torch.isfinite(step_loss)
        step_loss.backward()
        unreached = set(unused_modules(weights_without_gradient(model))) if unreached is None else unreached
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        last = loss(model.eval())
    assert torch.isfinite(last) and last < first, (first.item(), last.item())
    unchanged = sorted(n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, before[n]))
    assert set(unused_modules(unchanged)) == unreached, (unchanged[:5], sorted(unreached)[:5])
    assert len(unchanged) < len(before), "no trainable weight changed"
