"""Combinations of `qat:` / `quantization:` with other keys that cannot work, each refused by name."""

from __future__ import annotations

from hellbender.config.quantization import scheme_problems
from hellbender.config.schema import HellbenderConfig

_NO_SWITCH = ("nvfp4", "mxfp4")  # torchao's prototype NVFP4 / MX training layers cannot pause their fake quantization


def quantization_problems(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []
    for key in ("qat", "quantization"):
        scheme = getattr(cfg, key)
        if scheme is None:
            continue
        problems += scheme_problems(scheme, key)
        if scheme.quantize_embedding and scheme.weight_dtype not in ("int4", "int8"):
            problems.append(
                f"`{key}.quantize_embedding: true` with `{key}.weight_dtype: {scheme.weight_dtype}`: torchao quantizes "
                "an embedding table only to int4 or int8 weights. Remove `quantize_embedding`, or use an integer "
                "`weight_dtype`."
            )
    qat = cfg.qat
    if qat is None:
        return problems
    if cfg.quantization is not None:
        problems.append(
            "`qat:` and `quantization:` are both set. `hellbender quantize` stores a QAT-trained model with the `qat` "
            "scheme it trained against; `quantization:` is for a model trained without QAT. Keep one."
        )
    if cfg.adapter is not None:
        problems.append(
            f"`qat:` with `adapter: {cfg.adapter}`: torchao's quantization-aware training fake-quantizes a linear "
            "layer's own weight W, while a LoRA adapter trains B·A beside the frozen W; the merged model is then "
            "quantized as W + B·A, whose rounding training never saw, so the QAT would not do its job. Train the whole "
            "model with `qat:` (remove `adapter`), or train the adapter without `qat:` and quantize the merged model "
            "with `quantization:`."
        )
    elif cfg.load_in_4bit or cfg.load_in_8bit:
        problems.append(
            f"`qat:` with `{'load_in_4bit' if cfg.load_in_4bit else 'load_in_8bit'}: true`: quantization-aware "
            "training trains full-precision weights against their fake-quantized copies, and bitsandbytes' quantized "
            "weights cannot train. Remove the `load_in_*` key."
        )
    if cfg.rl or cfg.reward_model or cfg.distills:
        method = f"`rl: {cfg.rl}`" if cfg.rl else ("`reward_model: true`" if cfg.reward_model else "`kd_trainer`")
        problems.append(
            f"`qat:` with {method} is not supported yet: quantization-aware training is built and tested for "
            "supervised fine-tuning and continued pretraining, and these methods run a second model beside the "
            "trained one (a reference copy, a teacher) whose fake quantization nothing keeps in step. Train without "
            "`qat:` and quantize the result with `quantization:` (`hellbender quantize`)."
        )
    if qat.fake_quant_after_n_steps is not None:
        if qat.weight_dtype in _NO_SWITCH:
            problems.append(
                f"`qat.fake_quant_after_n_steps` with `qat.weight_dtype: {qat.weight_dtype}`: torchao's "
                f"{qat.weight_dtype} training layers have no switch to train without fake quantization first. Remove "
                "`fake_quant_after_n_steps` (fake-quantized from the first step)."
            )
        elif cfg.max_steps is not None and qat.fake_quant_after_n_steps >= cfg.max_steps:
            problems.append(
                f"`qat.fake_quant_after_n_steps: {qat.fake_quant_after_n_steps}` is not below `max_steps: "
                f"{cfg.max_steps}`: fake quantization would never switch on, and the run would train without QAT. "
                "Lower it, or remove `qat:`."
            )
    if qat.quantize_embedding and cfg.fuses_the_loss:
        problems.append(
            "`qat.quantize_embedding: true` with a fused cross-entropy (`liger_fused_linear_cross_entropy` / "
            "`cut_cross_entropy`): the fused loss multiplies by `lm_head`'s weight itself, past its fake quantization. "
            "Remove one of them."
        )
    return problems
