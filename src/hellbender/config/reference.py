"""The config reference: JSON schema for editors and the Markdown page docs/config.md (kept current by a test)."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from hellbender.config.accelerator import AcceleratorSettings, GradientAccumulationKwargs
from hellbender.config.adapter import AdapterSettings
from hellbender.config.data import DatasetEntry, DataSettings, PretrainingDatasetEntry
from hellbender.config.defaults import ENTRY_UNSET_MEANS, UNSET_MEANS
from hellbender.config.distillation import DistillationSettings
from hellbender.config.distributed import DistributedSettings, FsdpSettings
from hellbender.config.hub import HubSettings
from hellbender.config.kernels import KernelSettings
from hellbender.config.loss import LossSettings
from hellbender.config.model import ModelSettings
from hellbender.config.multimodal import MultimodalSettings
from hellbender.config.plugins import PluginSettings
from hellbender.config.preference import PreferenceSettings
from hellbender.config.quantization import QatSettings, QuantizationSettings
from hellbender.config.rl import RlSettings, TrlSettings
from hellbender.config.schema import HellbenderConfig
from hellbender.config.tracking import TrackingSettings
from hellbender.config.training import TrainingSettings

SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("Model and tokenizer", ModelSettings),
    ("Vision-language models", MultimodalSettings),
    ("Adapters", AdapterSettings),
    ("Data", DataSettings),
    ("Entries of `datasets:` and `test_datasets:`", DatasetEntry),
    ("Entries of `pretraining_dataset:`", PretrainingDatasetEntry),
    ("Training", TrainingSettings),
    ("Loss", LossSettings),
    ("Knowledge distillation", DistillationSettings),
    ("Preference tuning", PreferenceSettings),
    ("Online reinforcement learning", RlSettings),
    ("`trl:`", TrlSettings),
    ("Quantization-aware training and quantization", QuantizationSettings),
    ("`qat:` and `quantization:` (`quantization:` has every key but `fake_quant_after_n_steps`)", QatSettings),
    ("Fused kernels and compilation", KernelSettings),
    ("Several GPUs and machines", DistributedSettings),
    ("`fsdp_config:`", FsdpSettings),
    ("`accelerator_config:`", AcceleratorSettings),
    ("`accelerator_config.gradient_accumulation_kwargs:`", GradientAccumulationKwargs),
    ("Axolotl plugins", PluginSettings),
    ("Weights & Biases", TrackingSettings),
    ("Hugging Face Hub", HubSettings),
]


def config_json_schema() -> dict[str, Any]:
    return HellbenderConfig.model_json_schema()


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a shared value type (`Int`, `Name`): its base type is what the user writes
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list[{', '.join(_type_name(a) for a in typing.get_args(annotation))}]"
    if origin is dict:
        return f"dict[{', '.join(_type_name(a) for a in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(name: str, field: Any, unset_means: dict[str, str]) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return f"`null`: {unset_means[name]}" if name in unset_means else "decided at validation"
    return f"`{json.dumps(value)}`"


def config_markdown() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the schema by `hellbender schema --markdown`; a test keeps this page current.",
        "Key names follow Axolotl's. A key Axolotl defines that hellbender does not implement yet is refused",
        "by name (unless it is set to false or null); any other unknown key is an error with a suggestion.",
        'Defaults marked "decided at validation" depend on other keys; `hellbender validate --print` prints the value. Where a',
        "key may stay null, the table says what null means for it.",
        "",
    ]
    for title, model in SECTIONS:
        unset_means = ENTRY_UNSET_MEANS if model in (DatasetEntry, PretrainingDatasetEntry) else UNSET_MEANS
        lines += [f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            description = (field.description or "").replace("|", "\\|")
            lines.append(
                f"| `{name}` | {_type_name(field.annotation)} | {_default(name, field, unset_means)} | {description} |"
            )
        lines.append("")
    return "\n".join(lines)
