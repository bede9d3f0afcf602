"""Config keys for preference tuning (`rl:`) and reward models, with Axolotl's names, and the rules that tie each
method-specific key to its method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hellbender.config.unsupported import planned_feature
from hellbender.config.values import Float

if TYPE_CHECKING:
    from hellbender.config.schema import HellbenderConfig

PreferenceMethod = Literal["dpo", "ipo", "kto", "orpo", "simpo"]
# The methods whose trainer is built; the others are accepted by the schema and refused at validation.
BUILT_METHODS: frozenset[str] = frozenset({"dpo", "ipo"})
# The loss types TRL's DPOTrainer computes (its `DPOConfig.loss_type`); a test checks this list against TRL's.
DpoLossType = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
# The loss types that read `dpo_label_smoothing` (TRL's `label_smoothing`); every other one ignores it.
SMOOTHED_LOSSES = frozenset({"robust", "exo_pair", "aot", "aot_unpaired"})
DEFAULT_BETA = 0.1
# Axolotl's `rl` values for methods that generate during training: the planned online reinforcement learning.
ONLINE_METHODS = ("grpo", "gdpo", "ebft")

# method-specific key -> the `rl` methods it tunes
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "rl_beta": ("dpo", "ipo", "kto", "simpo"),
    "dpo_loss_type": ("dpo", "ipo"),
    "dpo_loss_weights": ("dpo",),
    "dpo_label_smoothing": ("dpo",),
    "rpo_alpha": ("dpo", "ipo"),
    "dpo_use_weighting": ("dpo", "ipo"),
    "dpo_norm_loss": ("dpo",),
    "precompute_ref_log_probs": ("dpo", "ipo"),
    "kto_desirable_weight": ("kto",),
    "kto_undesirable_weight": ("kto",),
    "orpo_alpha": ("orpo",),
    "simpo_gamma": ("simpo",),
    "cpo_alpha": ("simpo",),
}


class PreferenceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rl: PreferenceMethod | None = Field(
        None,
        description="Preference tuning on pairs of a chosen and a rejected answer to the same prompt, with TRL's "
        "trainers: `dpo` (Direct Preference Optimization; the loss is `dpo_loss_type`) or `ipo` (DPO with the IPO "
        "loss). `kto`, `orpo` and `simpo` are named but not built yet (refused). The reference model is the base "
        "model with the adapter switched off (LoRA / QLoRA), or a frozen copy of the starting weights (full "
        "fine-tuning; see `precompute_ref_log_probs`). See docs/preference.md.",
    )

    @field_validator("rl", mode="before")
    @classmethod
    def _online_methods_are_planned(cls, value: Any) -> Any:
        if value in ONLINE_METHODS:
            raise ValueError(
                f"`rl: {value}` belongs to {planned_feature('trl')}, which hellbender does not offer yet; the "
                "preference-tuning methods offered are `dpo` and `ipo`"
            )
        return value

    rl_beta: Float | None = Field(
        None,
        gt=0,
        description="How far the policy may move from the reference model: the DPO beta (the IPO tau with `rl: ipo` "
        "or `dpo_loss_type: [ipo]`); higher stays closer. Default 0.1 with `rl`. `dpo_beta` is its older spelling.",
    )
    dpo_loss_type: Annotated[list[DpoLossType], Field(min_length=1)] | None = Field(
        None,
        description="With `rl: dpo`: the loss, or several losses summed with `dpo_loss_weights` (TRL's `loss_type`): "
        "`sigmoid` (DPO, the default), `hinge`, `ipo`, `exo_pair`, `nca_pair`, `robust`, `bco_pair`, `sppo_hard`, "
        "`aot`, `aot_unpaired`, `apo_zero`, `apo_down`, `discopop`, `sft` (cross-entropy on the chosen answer), "
        "`sigmoid_norm` (DPO on per-token mean log-probabilities). With `rl: ipo` it is `[ipo]`.",
    )
    dpo_loss_weights: Annotated[list[Float], Field(min_length=1)] | None = Field(
        None,
        description="With several `dpo_loss_type`s: one weight per loss, in the same order; default 1.0 each.",
    )
    dpo_label_smoothing: Float | None = Field(
        None,
        ge=0,
        lt=0.5,
        description="With `rl: dpo`: the assumed probability that a preference label is flipped, read by the "
        "`robust`, `exo_pair`, `aot` and `aot_unpaired` losses (TRL's `label_smoothing`); refused with losses that "
        "ignore it, such as the default `sigmoid`.",
    )
    rpo_alpha: Float | None = Field(
        None,
        ge=0,
        description="RPO: add the chosen answer's mean token cross-entropy, weighted by this number, to the preference "
        "loss (TRL's `sft` loss type beside the others, with this weight).",
    )
    dpo_use_weighting: bool | None = Field(
        None,
        description="WPO: weight each pair's loss by the policy's length-normalised probability of its chosen and "
        "rejected answers (TRL's `use_weighting`).",
    )
    dpo_norm_loss: bool | None = Field(
        None,
        description="With the `sigmoid` loss: compare per-token mean log-probabilities instead of sums, so long "
        "answers do not dominate (read as `dpo_loss_type: [sigmoid_norm]`).",
    )
    precompute_ref_log_probs: bool | None = Field(
        None,
        description="Compute the reference model's log-probabilities of every pair once before training, so no "
        "reference model is kept in memory (full fine-tuning) and no reference forward pass runs per step.",
    )
    kto_desirable_weight: Float | None = Field(
        None, gt=0, description="With `rl: kto`: the weight of the loss on desirable answers (not built yet)."
    )
    kto_undesirable_weight: Float | None = Field(
        None, gt=0, description="With `rl: kto`: the weight of the loss on undesirable answers (not built yet)."
    )
    orpo_alpha: Float | None = Field(
        None,
        gt=0,
        description="With `rl: orpo`: the weight of the odds-ratio term beside the cross-entropy (not built yet).",
    )
    simpo_gamma: Float | None = Field(
        None, ge=0, description="With `rl: simpo`: the target reward margin (not built yet)."
    )
    cpo_alpha: Float | None = Field(
        None,
        ge=0,
        description="With `rl: simpo`: the weight of the cross-entropy on the chosen answer (not built yet).",
    )
    reward_model: bool | None = Field(
        None,
        description="Train a Bradley-Terry reward model (a sequence-classification head scoring chosen above "
        "rejected) instead of a language model; not with `rl` (not built yet).",
    )


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def preference_problems(cfg: HellbenderConfig) -> list[str]:
    """Each problem of the preference keys, one paragraph each."""
    problems: list[str] = []
    method = cfg.rl
    for key, methods in METHOD_KEYS.items():
        if not _is_set(getattr(cfg, key)) or method in methods:
            continue
        owners = " or ".join(f"`rl: {m}`" for m in methods)
        if method is None:
            problems.append(
                f"`{key}` tunes preference tuning with {owners}, but `rl` is not set, so it would change nothing. "
                f"Set `rl` to {' or '.join(methods)}, or remove `{key}`."
            )
        else:
            problems.append(
                f"`{key}` belongs to {owners}, but this config sets `rl: {method}`, which does not read it. Remove "
                f"`{key}`, or set `rl` to {' or '.join(methods)}."
            )
    if cfg.reward_model and method is not None:
        problems.append(
            f"`reward_model: true` and `rl: {method}` are both set: a reward model is trained on its own (a scoring "
            "head on preference pairs), not with a preference-tuning method. Keep one of them."
        )
    elif cfg.reward_model:
        problems.append(
            "`reward_model: true` asks for a Bradley-Terry reward model, which is not built yet: hellbender trains "
            "`rl: dpo` and `rl: ipo` today. Remove `reward_model` (reward models are planned)."
        )
    if method is not None and method not in BUILT_METHODS:
        problems.append(
            f"`rl: {method}` is not built yet: hellbender's preference tuning offers `rl: dpo` and `rl: ipo` today "
            f"(the {method.upper()} trainer is planned). Use `rl: dpo` (its `dpo_loss_type` offers further losses), "
            "or remove `rl` to train with supervised fine-tuning."
        )
    if method in BUILT_METHODS:
        problems += _dpo_problems(cfg)
    return problems


def _dpo_problems(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []
    losses = list(cfg.dpo_loss_type or [])
    if cfg.rl == "ipo" and losses not in ([], ["ipo"]):
        problems.append(
            f"`dpo_loss_type: {losses}` with `rl: ipo`: `rl: ipo` is DPO with the IPO loss only. Remove "
            "`dpo_loss_type`, or set `rl: dpo` to choose the losses."
        )
    losses = dpo_losses(cfg)
    if cfg.dpo_loss_weights is not None and len(cfg.dpo_loss_weights) != len(cfg.dpo_loss_type or ["sigmoid"]):
        problems.append(
            f"`dpo_loss_weights` has {len(cfg.dpo_loss_weights)} weight(s) for {len(cfg.dpo_loss_type or [1])} "
            "loss type(s) in `dpo_loss_type`: give one weight per loss, in the same order."
        )
    if cfg.dpo_norm_loss and (cfg.dpo_loss_type or ["sigmoid"]) != ["sigmoid"]:
        problems.append(
            f"`dpo_norm_loss: true` length-normalises the `sigmoid` loss, and `dpo_loss_type` is {cfg.dpo_loss_type}. "
            "Remove `dpo_norm_loss` (for normalised DPO, `dpo_loss_type: [sigmoid_norm]` says the same)."
        )
    if cfg.rpo_alpha is not None and "sft" in (cfg.dpo_loss_type or []):
        problems.append(
            "`rpo_alpha` adds the `sft` loss, and `dpo_loss_type` names `sft` already. Keep one: `rpo_alpha`, or "
            "`sft` in `dpo_loss_type` with its weight in `dpo_loss_weights`."
        )
    if cfg.dpo_label_smoothing and not SMOOTHED_LOSSES & set(losses):
        problems.append(
            f"`dpo_label_smoothing` is read only by the `robust`, `exo_pair`, `aot` and `aot_unpaired` losses, and "
            f"this run's losses are {losses}: it would change nothing. For conservative DPO with flipped labels, set "
            "`dpo_loss_type: [robust]`; otherwise remove `dpo_label_smoothing`."
        )
    if "exo_pair" in losses and not cfg.dpo_label_smoothing:
        problems.append(
            "The `exo_pair` loss needs `dpo_label_smoothing` above 0 (its epsilon; the EXO paper suggests 0.001)."
        )
    if cfg.dpo_use_weighting and {"aot", "aot_unpaired"} & set(losses):
        problems.append(
            "`dpo_use_weighting` weights each pair, and the `aot` losses sort the pairs of a batch, so the weights "
            "would land on other pairs. Remove `dpo_use_weighting`, or choose another loss."
        )
    problems += _sft_only_problems(cfg)
    return problems


def _sft_only_problems(cfg: HellbenderConfig) -> list[str]:
    """Keys of supervised fine-tuning that preference tuning cannot honour yet."""
    refused = {
        "sample_packing": (
            cfg.sample_packing,
            "TRL's preference trainer pads each pair; packed rows are not offered for it yet",
        ),
        "liger_fused_linear_cross_entropy": (
            cfg.fuses_the_loss,
            "the preference trainer computes log-probabilities through its own fused LM head, so Liger's fused "
            "cross-entropy (also asked for by `cut_cross_entropy`) would never run",
        ),
        "use_eaft": (
            cfg.use_eaft,
            "it weights the cross-entropy of supervised fine-tuning, which DPO does not compute",
        ),
        "streaming": (cfg.uses_streaming, "preference pairs are prepared and cached before training, not streamed"),
        "processor_type": (cfg.is_multimodal, "vision-language preference tuning is not built yet"),
        "deepspeed": (bool(cfg.deepspeed), "preference tuning with DeepSpeed is not verified yet"),
        "fsdp_version": (cfg.uses_fsdp2, "preference tuning with FSDP is not verified yet"),
    }
    return [
        f"`{key}` cannot be used with `rl: {cfg.rl}`: {why}. Remove `{key}` (preference tuning runs on one process "
        "or several with `--nproc`)."
        for key, (asked, why) in refused.items()
        if asked
    ]


def dpo_losses(cfg: HellbenderConfig) -> list[str]:
    """The TRL loss types this config trains with, `rpo_alpha`'s `sft` term included."""
    losses = ["ipo"] if cfg.rl == "ipo" else list(cfg.dpo_loss_type or ["sigmoid"])
    if cfg.dpo_norm_loss and losses == ["sigmoid"]:
        losses = ["sigmoid_norm"]
    if cfg.rpo_alpha is not None:
        losses.append("sft")
    return losses


def dpo_loss_weights(cfg: HellbenderConfig) -> list[float] | None:
    """One weight per loss of `dpo_losses`, or None for TRL's equal weights."""
    if cfg.rpo_alpha is None:
        return list(cfg.dpo_loss_weights) if cfg.dpo_loss_weights is not None else None
    preference = list(cfg.dpo_loss_weights) if cfg.dpo_loss_weights is not None else [1.0] * (len(dpo_losses(cfg)) - 1)
    return [*preference, cfg.rpo_alpha]


# What leaving each key out means (docs/config.md and `hellbender validate --print` state it).
PREFERENCE_UNSET_MEANS: dict[str, str] = {
    "rl": "no preference tuning (supervised fine-tuning)",
    "rl_beta": "0.1 with `rl`",
    "dpo_loss_type": "`[sigmoid]` (`[ipo]` with `rl: ipo`)",
    "dpo_loss_weights": "1.0 for each loss",
    "dpo_label_smoothing": "0 (labels trusted)",
    "rpo_alpha": "no cross-entropy term",
    "dpo_use_weighting": "every pair weighs the same",
    "dpo_norm_loss": "summed log-probabilities",
    "precompute_ref_log_probs": "the reference scores each batch as it trains",
    "kto_desirable_weight": "1.0",
    "kto_undesirable_weight": "1.0",
    "orpo_alpha": "TRL's default",
    "simpo_gamma": "TRL's default",
    "cpo_alpha": "TRL's default",
    "reward_model": "no reward model",
}
