"""Axolotl's `plugins:` list, read by name. A plugin whose job hellbender does natively is accepted (its keys are
hellbender keys, or are mapped onto them); any other is refused, naming it and what hellbender offers instead."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hellbender.config.distillation import KD_PLUGIN
from hellbender.config.values import Name

AXOLOTL_INTEGRATIONS = "axolotl.integrations."
SWANLAB_PLUGIN = "axolotl.integrations.swanlab.SwanLabPlugin"
CUT_CROSS_ENTROPY_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
# plugins hellbender does natively -> how
NATIVE_PLUGINS: dict[str, str] = {
    "axolotl.integrations.liger.LigerPlugin": "the `liger_*` keys turn on Liger's kernels",
    CUT_CROSS_ENTROPY_PLUGIN: (
        "the fused LM head and loss (`cut_cross_entropy`, on by default with this plugin) is Liger's fused linear "
        "cross-entropy"
    ),
    SWANLAB_PLUGIN: "the `use_swanlab` / `swanlab_*` keys report to SwanLab (on by default with this plugin)",
    KD_PLUGIN: "knowledge distillation (`kd_trainer`, on by default with this plugin, and the `kd_*` keys)",
}
# other plugins Axolotl users list -> what hellbender offers instead
OTHER_PLUGINS: dict[str, str] = {
    "axolotl.integrations.kernels.KernelsPlugin": (
        "its expert kernels belong to mixture-of-experts training, which hellbender does not offer yet; `liger_*` "
        "keys give fused norms, MLPs, RoPE and loss"
    ),
    "axolotl.integrations.expert_parallel.ExpertParallelPlugin": (
        "expert parallelism belongs to mixture-of-experts training, which hellbender does not offer yet"
    ),
    "axolotl.integrations.diffusion.DiffusionPlugin": "diffusion language-model training is not offered",
    "axolotl.integrations.llm_compressor.LLMCompressorPlugin": (
        "sparse fine-tuning with LLM Compressor is not offered; train dense, then compress with LLM Compressor itself"
    ),
    "axolotl.integrations.grokfast.GrokfastPlugin": "the Grokfast optimizer wrapper is not offered",
    "axolotl.integrations.lm_eval.LMEvalPlugin": "lm-eval benchmarks are not run by hellbender; `hellbender evaluate` "
    "gives loss, perplexity and token accuracy",
    "axolotl.integrations.spectrum.SpectrumPlugin": "Spectrum's layer selection is not offered; name the modules to "
    "train with `lora_target_modules`",
}


class PluginSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plugins: list[Name] = Field(
        default_factory=list,
        description="Axolotl plugins, read by name: `axolotl.integrations.liger.LigerPlugin` (the `liger_*` keys), "
        "`axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin` (`cut_cross_entropy`) and "
        "`axolotl.integrations.swanlab.SwanLabPlugin` (`use_swanlab`) and `axolotl.integrations.kd.KDPlugin` (`kd_trainer`) are done natively; others are refused, naming "
        "what hellbender offers instead.",
    )


def plugin_problems(plugins: list[str]) -> list[str]:
    problems = []
    for name in plugins:
        if name in NATIVE_PLUGINS:
            continue
        instead = OTHER_PLUGINS.get(name)
        if instead is None:
            short = name.removeprefix(AXOLOTL_INTEGRATIONS)
            instead = f"hellbender has no plugins; it does natively what {', '.join(sorted(NATIVE_PLUGINS))} do"
            name = f"{AXOLOTL_INTEGRATIONS}{short}" if name.startswith(AXOLOTL_INTEGRATIONS) else name
        problems.append(f"`plugins`: `{name}` is not supported: {instead}. Remove it from `plugins`.")
    return problems
