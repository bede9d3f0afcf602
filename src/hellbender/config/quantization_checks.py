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
    if cfg.load_in_4bit or cfg.load_in_8bit or cfg.adapter == "qlora":
        key = "load_in_8bit: true" if cfg.load_in_8bit else "adapter: qlora" if cfg.adapter else "load_in_4bit: true"
        problems.append(
            f"`qat:` with `{key}`: quantization-aware training fake-quantizes full-precision weights (with an adapter, "
            "the merged weight W + B·A that `hellbender quantize` stores), and a bitsandbytes-quantized base holds "
            "no full-precision W to merge into. Train `adapter: lora` on the unquantized base (remove the "
            "`load_in_*` key), or train QLoRA without `qat:` and quantize the merged model with `quantization:`."
        )
    elif cfg.adapter is not None:
        problems += _adapter_problems(cfg)
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


def _adapter_problems(cfg: HellbenderConfig) -> list[str]:
    """`qat:` with LoRA trains each adapted layer against its fake-quantized merged weight fq(W + s·B·A), exactly the
    weight `hellbender quantize` stores after merging: what that merged form cannot express is refused."""
    qat = cfg.qat
    assert qat is not None
    problems: list[str] = []
    merged = (
        "under `qat:` a LoRA layer computes with its fake-quantized merged weight fq(W + s·B·A), the weight "
        "`hellbender quantize` stores after merging the adapter"
    )
    if cfg.lora_dropout:
        problems.append(
            f"`lora_dropout: {cfg.lora_dropout:g}` with `qat:`: {merged}, and dropout drops entries of the LoRA "
            "branch's input only, which a merged weight cannot express (training would see another model than the "
            "one stored). Set `lora_dropout: 0`."
        )
    if cfg.peft_use_dora:
        problems.append(
            f"`peft_use_dora: true` with `qat:`: {merged}, which hellbender builds for plain LoRA only (DoRA "
            "rescales every column of the merged weight by a learned magnitude, in PEFT's own DoRA forward). Remove "
            "`peft_use_dora`, or train DoRA without `qat:` and quantize the merged model with `quantization:`."
        )
    if qat.weight_dtype in _NO_SWITCH:
        problems.append(
            f"`qat.weight_dtype: {qat.weight_dtype}` with `adapter: {cfg.adapter}`: {merged}, and torchao's "
            f"{qat.weight_dtype} training layers round inside their own matmul, with no fake quantizer to apply to "
            "the merged weight. Use an integer or `float8` scheme with an adapter, or train the whole model (remove "
            "`adapter`)."
        )
    if cfg.loftq is not None:
        problems.append(
            f"`peft.loftq_config` with `qat:`: {merged}, and LoftQ replaces each adapted base weight W by a "
            "bitsandbytes-rounded copy when the adapter is created (and again when it is loaded to merge), so the "
            "stored weight would depend on that rounding repeating bit for bit. Remove `peft.loftq_config`."
        )
    return problems
