"""`hellbender quantize`: a trained model stored quantized with torchao, in the format transformers loads with its
`TorchAoConfig` (`AutoModelForCausalLM.from_pretrained(DIR)` gives the quantized model back).

The scheme is the config's `qat:` block (the one the model was trained against) or, for a model trained without
QAT, `quantization:`. A model trained with `qat:` records its scheme in config.json (`hellbender_qat`), a LoRA adapter
in `hellbender_qat.json` beside adapter_config.json: a config without either block quantizes with that one, and a
config asking for another scheme is refused, since the weights learned to sit where the recorded scheme rounds them.
An adapter is first merged into its base model, by `merge-lora`'s code. Quantization runs through transformers' own
path (the model is loaded with a `TorchAoConfig`), which quantizes with the same torchao config QAT fake-quantized
with: the layers QAT fake-quantized are exactly the layers quantized, so the stored model computes what training saw
(for an adapter: the fake-quantized merged weight, models/qat_lora.py)."""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.defaults import default_model_type
from hellbender.config.quantization import QuantizationScheme
from hellbender.config.quantization_machine import machine_problem
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models.qat import ADAPTER_RECORD_FILE, RECORD_KEY, check_fits
from hellbender.models.torchao_schemes import embedding_config, linear_config
from hellbender.storage import (
    FINAL_MANIFEST,
    make_directory,
    write_directory_atomically,
    write_file_atomically,
    write_manifest,
)
from hellbender.use.trained import TrainedDir, find_trained

logger = logging.getLogger("hellbender")
QUANTIZE_INFO = "hellbender_quantize.json"


def quantize(cfg: HellbenderConfig, model: str | Path | None = None, output: str | Path | None = None) -> Path:
    """Quantize the trained model (default: the final one in `output_dir`; a LoRA adapter is merged into
    `base_model` first) and save it in `output` (default `<output_dir>/quantized`); returns that directory."""
    trained = find_trained(cfg, model, "--model")
    if trained.is_adapter:
        return _quantize_adapter(cfg, trained, output)
    saved = json.loads((trained.path / "config.json").read_text())
    if saved.get("quantization_config"):
        raise ConfigError(
            f"{trained.path} holds a model that is already quantized "
            f"({saved['quantization_config'].get('quant_method', 'unknown method')}); quantize the unquantized "
            "trained model instead (the run's `output_dir`, a `checkpoint-N` or a merged model)."
        )
    key, scheme = _scheme(cfg, saved.get(RECORD_KEY), trained.path)
    if problem := machine_problem(scheme, key):
        raise EnvironmentProblem(problem)
    target = _target(cfg, output, trained.path)
    info = _info(trained, key, scheme, trained_with_qat=saved.get(RECORD_KEY) is not None)
    _quantize_saved(cfg, trained.path, scheme, key, target, info)
    logger.info("Quantized %s (%s); saved to %s", trained.describe(), scheme.describe(), target)
    return target


def _quantize_adapter(cfg: HellbenderConfig, trained: TrainedDir, output: str | Path | None) -> Path:
    """A LoRA adapter: merged into the base as `merge-lora` merges it (into a temporary directory beside the target,
    removed afterwards), then quantized. An adapter trained with `qat:` records its scheme beside adapter_config.json;
    under QAT its layers computed with the fake-quantized merged weight, which is what is quantized here."""
    if cfg.adapter is None:
        raise ConfigError(
            f"{trained.path} holds a LoRA adapter, and this config has no `adapter:` to say how it sits on its base "
            "model. Quantize with the config the adapter was trained with (it merges the adapter into `base_model` "
            "first), or pass a whole model with `--model`."
        )
    record = trained.path / ADAPTER_RECORD_FILE
    recorded = _read_adapter_record(record) if record.is_file() else None
    key, scheme = _scheme(cfg, recorded, trained.path, ADAPTER_RECORD_FILE)
    if problem := machine_problem(scheme, key):
        raise EnvironmentProblem(problem)
    target = _target(cfg, output, trained.path)
    from hellbender.models.loading import model_skeleton
    from hellbender.use.merge import merge_lora

    check_fits(model_skeleton(cfg), scheme, key)  # before the merge, which takes a while on a large model
    info = _info(trained, key, scheme, trained_with_qat=recorded is not None, merged_from_adapter=True)
    make_directory(target.parent)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.merging-", dir=target.parent) as scratch:
        merged = merge_lora(cfg, adapter=trained.path, output=Path(scratch) / "merged")
        _quantize_saved(cfg, merged, scheme, key, target, info)
    logger.info("Merged and quantized %s (%s); saved to %s", trained.describe(), scheme.describe(), target)
    return target


def _info(trained: TrainedDir, key: str, scheme: QuantizationScheme, **facts: bool) -> dict[str, Any]:
    """What `quantize` records beside the quantized model: its source, the scheme, and how it was trained."""
    return {
        "source": str(trained.path),
        "source_step": trained.step,
        "scheme_key": key,
        "scheme": scheme.settings(),
        **facts,
    }


def _read_adapter_record(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return path.read_text()  # refused by `_recorded_scheme`, naming what it holds


def _target(cfg: HellbenderConfig, output: str | Path | None, source: Path) -> Path:
    target = Path(output).expanduser() if output is not None else Path(cfg.output_dir) / "quantized"
    _check_target(target, source)
    return target


def _quantize_saved(
    cfg: HellbenderConfig, path: Path, scheme: QuantizationScheme, key: str, target: Path, info: dict[str, Any]
) -> None:
    """Load the whole model saved in `path` quantized with `scheme` (transformers' TorchAoConfig) and save it."""
    import transformers
    from transformers import TorchAoConfig

    from hellbender.models.loading import load_tokenizer_and_processor

    cls = getattr(transformers, cfg.model_type or default_model_type(cfg))
    check_fits(_skeleton(cls, path), scheme, key)  # before torchao fails half-way through the weights
    quantized = cls.from_pretrained(
        str(path), dtype="auto", quantization_config=_torchao_config(TorchAoConfig, scheme, cls, path)
    )
    tokenizer, processor = load_tokenizer_and_processor(cfg)  # with the chat template training used, as merge-lora
    _save(quantized, processor or tokenizer, target, info)


def _scheme(
    cfg: HellbenderConfig, recorded: Any, path: Path, where: str = f"config.json (`{RECORD_KEY}`)"
) -> tuple[str, QuantizationScheme]:
    """(the key that names the scheme, the scheme) for this model; `where`: the file in `path` that records the scheme
    QAT trained it against (`recorded`, None for a model trained without QAT)."""
    trained_with = _recorded_scheme(recorded, path, where) if recorded is not None else None
    key = "qat" if cfg.qat is not None else "quantization"
    asked = cfg.quantize_scheme
    if asked is None:
        if trained_with is None:
            raise ConfigError(
                f"`quantize` needs a scheme, and this config has neither `qat:` nor `quantization:`, and {path} was "
                "trained without QAT. Add a `quantization:` block (e.g. `weight_dtype: int4`, `activation_dtype: "
                "int8`, `group_size: 32`); see docs/quantization.md."
            )
        return "qat", trained_with
    asked = QuantizationScheme(**asked.settings())
    if trained_with is not None and asked != trained_with:
        raise ConfigError(
            f"{path} was trained with `qat:` against {trained_with.describe()} (recorded in its {where}), and "
            f"`{key}:` asks for {asked.describe()}: the weights learned to sit where the trained scheme rounds them. "
            f"Set `{key}:` to the trained scheme ({trained_with.settings()}), or remove it to use the recorded one."
        )
    return key, asked


def _recorded_scheme(recorded: Any, path: Path, where: str) -> QuantizationScheme:
    from pydantic import ValidationError

    try:
        return QuantizationScheme(**recorded)
    except (TypeError, ValidationError):
        raise ConfigError(
            f"{path} records a QAT scheme in its {where} that is not one: {recorded!r}. It was edited or written by "
            "another tool; restore it, or remove the record and name the scheme with `quantization:`."
        ) from None


def _skeleton(cls: Any, path: Path) -> Any:
    import torch
    from transformers import AutoConfig

    with torch.device("meta"):
        return cls.from_config(AutoConfig.from_pretrained(str(path)))


def _torchao_config(torchao_config_cls: Any, scheme: QuantizationScheme, cls: Any, path: Path) -> Any:
    """transformers' TorchAoConfig for `scheme`: every linear layer but `lm_head`; with `quantize_embedding` also
    `lm_head` (the linear scheme, as QAT fake-quantized it) and the input embedding (integer weight-only)."""
    if not scheme.quantize_embedding:
        return torchao_config_cls(quant_type=linear_config(scheme))
    from torchao.quantization import FqnToConfig

    skeleton = _skeleton(cls, path)
    embedding = skeleton.get_input_embeddings()
    name = next(name for name, module in skeleton.named_modules() if module is embedding)
    # `_default` is what transformers' quantizer applies to every other linear layer (a `re:.*` key would reach the
    # norms' weights too); torchao 0.18 warns that it will go in a later release.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Config Deprecation: _default")
        configs = FqnToConfig({"_default": linear_config(scheme), name: embedding_config(scheme)})
    return torchao_config_cls(quant_type=configs, include_input_output_embeddings=True)


def _check_target(target: Path, source: Path) -> None:
    """The output may be new, or a directory an earlier `quantize` wrote (replaced whole); nothing else."""
    if target.resolve() == source.resolve() or source.resolve().is_relative_to(target.resolve()):
        raise ConfigError(
            f"`--output {target}` would replace the model it quantizes ({source}); choose another directory (the "
            "default is `<output_dir>/quantized`)."
        )
    if target.exists() and not (target / QUANTIZE_INFO).is_file():
        state = "a file" if not target.is_dir() else "a directory that an earlier `quantize` did not write"
        raise ConfigError(
            f"`--output {target}` is {state}; it is left alone. Choose a new directory, or remove it first."
        )


def _save(model: Any, tokenizer_or_processor: Any, target: Path, info: dict[str, Any]) -> None:
    def write(staging: Path) -> None:
        model.save_pretrained(str(staging))
        tokenizer_or_processor.save_pretrained(str(staging))
        write_file_atomically(staging / QUANTIZE_INFO, json.dumps(info, indent=1))
        write_manifest(staging, FINAL_MANIFEST)

    write_directory_atomically(target, write)  # an earlier quantize there is replaced whole
