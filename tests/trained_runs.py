"""Short LoRA runs on the built-in tiny models, trained once per test session (fixtures in conftest.py) and used by
the tests of what comes after training: merge-lora, inference, evaluate and the run report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

TEXT_STEPS = 20
VLM_STEPS = 4


@dataclass
class TrainedRun:
    config: Path  # the YAML file the commands take
    raw: dict  # its keys
    reports_at_save: dict[int, str] = field(default_factory=dict)  # step -> report.md right after that save

    @property
    def output_dir(self) -> Path:
        return Path(self.raw["output_dir"])


def _report_recorder(run: TrainedRun):
    from transformers import TrainerCallback

    class RecordReportAtSave(TrainerCallback):
        """Runs after hellbender's own callbacks, so it sees the report each save wrote."""

        def on_save(self, args, state, control, **kwargs):
            page = Path(args.output_dir) / "report" / "report.md"
            run.reports_at_save[state.global_step] = page.read_text() if page.is_file() else ""

    return RecordReportAtSave()


def _train(root: Path, raw: dict) -> TrainedRun:
    from hellbender.config import validate_config
    from hellbender.train.run import train

    root.mkdir(parents=True, exist_ok=True)
    config = root / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    run = TrainedRun(config, raw)
    train(validate_config(dict(raw)), callbacks=[_report_recorder(run)])
    return run


def train_text_lora(root: Path) -> TrainedRun:
    """tiny-llama, LoRA on every linear layer plus a trained lm_head; 8 held-out rows scored in one batch at steps
    10 and 20 (so the Trainer's eval loss is a token-weighted mean, like `evaluate`'s); checkpoints at 10 and 20."""
    from tests.helpers import base_config

    raw = base_config(
        root,
        adapter="lora",
        lora_target_linear=True,
        lora_modules_to_save=["lm_head"],
        max_steps=TEXT_STEPS,
        val_set_size=8,
        eval_batch_size=8,
        eval_steps=10,
        save_steps=10,
    )
    return _train(root, raw)


def train_vlm_lora(root: Path) -> TrainedRun:
    """The tiny Qwen2.5-VL on the coloured squares, LoRA on the language model; 4 held-out rows, one batch."""
    from tests.helpers import vlm_config
    from tests.tiny_vlms import QWEN

    raw = vlm_config(
        root,
        QWEN,
        adapter="lora",
        lora_target_linear=True,
        max_steps=VLM_STEPS,
        learning_rate=3e-3,
        val_set_size=4,
        eval_batch_size=4,
        eval_steps=2,
        save_steps=2,
    )
    return _train(root, raw)


def base_model_dir(run: TrainedRun) -> Path:
    from hellbender.models.tiny import tiny_model_dir

    return tiny_model_dir(run.raw["base_model"])


def model_class(run: TrainedRun):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if run.raw.get("processor_type") else AutoModelForCausalLM


def load_base(run: TrainedRun):
    """The base model with plain transformers, fp32, in evaluation mode."""
    import torch

    return model_class(run).from_pretrained(base_model_dir(run), dtype=torch.float32).eval()


def load_with_peft(run: TrainedRun, adapter_dir: Path | None = None):
    """Base model + saved adapter with plain transformers and PEFT (no hellbender code), fp32, evaluation mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(run), str(adapter_dir or run.output_dir)).eval()
