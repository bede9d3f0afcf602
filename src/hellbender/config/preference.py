"""Config keys for preference tuning (`rl:`) and reward models, with Axolotl's names, and which method each
method-specific key belongs to (the rules are in `preference_checks.py`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hellbender.config.unsupported import planned_feature
from hellbender.config.values import Float, Int

PreferenceMethod = Literal["dpo", "ipo", "kto", "orpo", "simpo", "grpo", "gdpo", "rloo"]
# The offline methods that score answers against a reference model (ORPO, SimPO and reward models have none).
REFERENCE_METHODS = ("dpo", "ipo", "kto")
# The loss types TRL's DPOTrainer computes (its `DPOConfig.loss_type`); a test checks this list against TRL's.
DpoLossType = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
# The loss types that read `dpo_label_smoothing` (TRL's `label_smoothing`); every other one ignores it.
SMOOTHED_LOSSES = frozenset({"robust", "exo_pair", "aot", "aot_unpaired"})
DEFAULT_BETA = 0.1
# The method defaults TRL's configs have (KTOConfig, ORPOConfig, CPOConfig), which Axolotl leaves in place; validation
# writes them into the config so `validate --print` shows what trains.
DEFAULT_ORPO_ALPHA = 0.1
DEFAULT_SIMPO_GAMMA = 0.5
DEFAULT_CPO_ALPHA = 1.0
DEFAULT_KTO_WEIGHT = 1.0
# Axolotl's `rl` values for methods that generate during training and are not offered yet (`grpo`, `gdpo` and `rloo`
# are).
ONLINE_METHODS = ("ebft",)

# method-specific key -> the `rl` methods it tunes
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "rl_beta": ("dpo", "ipo", "kto", "simpo"),
    "dpo_loss_type": ("dpo", "ipo"),
    "dpo_loss_weights": ("dpo",),
    "dpo_label_smoothing": ("dpo",),
    "rpo_alpha": ("dpo", "ipo"),
    "dpo_use_weighting": ("dpo", "ipo"),
    "dpo_norm_loss": ("dpo",),
    "precompute_ref_log_probs": REFERENCE_METHODS,
    "dpo_shared_prompt": ("dpo", "ipo"),
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
        "trainers: `dpo` (Direct Preference Optimization; the loss is `dpo_loss_type`), `ipo` (DPO with the IPO "
        "loss), `kto` (unpaired rows labelled desirable or not), `orpo` (odds ratio beside the cross-entropy, no "
        "reference model) or `simpo` (length-normalised margin, no reference model). The reference model of DPO, IPO "
        "and KTO is the base model with the adapter switched off (LoRA / QLoRA), or a frozen copy of the starting "
        "weights (full fine-tuning; see `precompute_ref_log_probs`). See docs/preference.md. `grpo`: online "
        "reinforcement learning (Group Relative Policy Optimization): the model generates several completions per "
        "prompt, the `trl.reward_funcs` score them, and it learns from rewards relative to the group (the `trl:` "
        "block; docs/rl.md). `gdpo`: GRPO with each reward function normalised within the group before they are summed "
        "(`trl.multi_objective_aggregation: normalize_then_sum`). `rloo`: the same with REINFORCE Leave-One-Out, whose baseline for each completion is "
        "the mean reward of the other completions of its prompt (TRL's RLOOTrainer).",
    )

    @field_validator("rl", mode="before")
    @classmethod
    def _online_methods_are_planned(cls, value: Any) -> Any:
        if value in ONLINE_METHODS:
            raise ValueError(
                f"`rl: {value}` belongs to {planned_feature('ebft')}, which hellbender does not offer yet; the "
                "methods offered are `dpo`, `ipo`, `kto`, `orpo`, `simpo`, `grpo`, `gdpo` and `rloo`"
            )
        return value

    rl_beta: Float | None = Field(
        None,
        gt=0,
        description="How far the policy may move from the reference model: the DPO beta (the IPO tau with `rl: ipo` "
        "or `dpo_loss_type: [ipo]`), KTO's beta, SimPO's reward scale; higher stays closer. Default 0.1 with `rl: "
        "dpo`, `ipo`, `kto` or `simpo`. `dpo_beta` is its older spelling.",
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
        description="Compute the reference model's log-probabilities of every pair (KTO: every row) once before "
        "training, so no "
        "reference model is kept in memory (full fine-tuning) and no reference forward pass runs per step.",
    )
    dpo_shared_prompt: bool | None = Field(
        None,
        description="With `rl: dpo` or `ipo`: score each pair in one row that holds its prompt once, the rejected "
        "answer masked from the chosen one, instead of two rows that each hold the prompt (the same log-probabilities "
        "up to float rounding, at fewer tokens: a 1,024-token prompt with two 1,024-token answers runs 3,073 tokens "
        "instead of 4,096). Unset: on for text models on a GPU with SDPA or flex attention and only full-attention "
        "layers (flex attention's block mask skips what is masked), two rows elsewhere (the start of the run says "
        "which); `true` also uses a dense mask (CPU, eager attention) and refuses a model it cannot "
        "serve; `false` keeps TRL's two rows.",
    )
    kto_desirable_weight: Float | None = Field(
        None, gt=0, description="With `rl: kto`: the weight of the loss on desirable answers (default 1.0)."
    )
    kto_undesirable_weight: Float | None = Field(
        None, gt=0, description="With `rl: kto`: the weight of the loss on undesirable answers (default 1.0)."
    )
    orpo_alpha: Float | None = Field(
        None,
        gt=0,
        description="With `rl: orpo`: the weight of the odds-ratio term beside the cross-entropy of the chosen answer "
        "(the ORPO paper's lambda; TRL's `beta`); default 0.1.",
    )
    simpo_gamma: Float | None = Field(
        None, ge=0, description="With `rl: simpo`: the target reward margin (gamma); default 0.5."
    )
    cpo_alpha: Float | None = Field(
        None,
        ge=0,
        description="With `rl: simpo`: the weight of the cross-entropy on the chosen answer; default 1.0 (CPO-SimPO, "
        "TRL's and Axolotl's default), 0 for the paper's SimPO.",
    )
    reward_model: bool | None = Field(
        None,
        description="Train a Bradley-Terry reward model on preference pairs: the model is loaded as a "
        "sequence-classification model with one label (`model_type: AutoModelForSequenceClassification`), its score "
        "head trained (and saved beside a LoRA adapter), scoring chosen above rejected. Not with `rl`.",
    )
    num_labels: Int | None = Field(
        None,
        description="With `reward_model: true`: the score head's outputs, which must be 1 (one reward per sequence; "
        "the default).",
    )
    center_rewards_coefficient: Float | None = Field(
        None,
        ge=0,
        description="With `reward_model: true`: add this weight times the mean over pairs of (chosen score + rejected "
        "score)² to the loss, so the rewards stay centred on zero (TRL's `center_rewards_coefficient`, e.g. 0.01).",
    )


# What leaving each key out means (docs/config.md and `hellbender validate --print` state it).
PREFERENCE_UNSET_MEANS: dict[str, str] = {
    "rl": "no preference tuning (supervised fine-tuning)",
    "rl_beta": "0.1 with `rl: dpo`, `ipo`, `kto` or `simpo`",
    "dpo_loss_type": "`[sigmoid]` (`[ipo]` with `rl: ipo`)",
    "dpo_loss_weights": "1.0 for each loss",
    "dpo_label_smoothing": "0 (labels trusted)",
    "rpo_alpha": "no cross-entropy term",
    "dpo_use_weighting": "every pair weighs the same",
    "dpo_norm_loss": "summed log-probabilities",
    "precompute_ref_log_probs": "the reference scores each batch as it trains",
    "dpo_shared_prompt": "the prompt once per pair on a GPU where the model allows it (text models with SDPA or flex "
    "attention and only full-attention layers), two rows per pair elsewhere",
    "kto_desirable_weight": "1.0 with `rl: kto`",
    "kto_undesirable_weight": "1.0 with `rl: kto`",
    "orpo_alpha": "0.1 with `rl: orpo`",
    "simpo_gamma": "0.5 with `rl: simpo`",
    "cpo_alpha": "1.0 with `rl: simpo`",
    "reward_model": "no reward model",
    "num_labels": "1 with `reward_model` (no score head otherwise)",
    "center_rewards_coefficient": "no centring term",
}
