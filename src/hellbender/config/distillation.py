"""Config keys of knowledge distillation (Axolotl's KD plugin keys, plus `kd_teacher_model`): the student learns from
a teacher's top-k token distributions, stored with the data (offline) or computed by a teacher model running in the
same process (online). The loss is `train/distillation_loss.py`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hellbender.config.values import Float, Int, PathText

KD_PLUGIN = "axolotl.integrations.kd.KDPlugin"
# Axolotl's dataset type of chat rows with the teacher's top-k per position (its `load`; `.load_legacy` reads the
# older `{"token": "token_id:N", "logprob": x}` entries).
KD_CHAT_TYPE = "axolotl.integrations.kd.chat_template"
KD_LEGACY_CHAT_TYPE = "axolotl.integrations.kd.chat_template.load_legacy"
KD_DATASET_TYPES = (KD_CHAT_TYPE, KD_LEGACY_CHAT_TYPE)
# The tuning keys that mean nothing without `kd_trainer`.
KD_TUNING_KEYS = (
    "kd_ce_alpha",
    "kd_alpha",
    "kd_temperature",
    "kd_beta",
    "kd_normalize_topk",
    "kd_top_k_before_softmax",
    "kd_zscore_base_temp",
    "kd_teacher_model",
    "kd_online_topk",
    "kd_fused_loss",
)


class DistillationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kd_trainer: bool | None = Field(
        None,
        description="Knowledge distillation: train on `kd_alpha` x the KL divergence from the teacher's top-k "
        "distribution at each trained position plus `kd_ce_alpha` x the usual cross-entropy. The teacher's top-k "
        "comes with the data (a dataset entry with `logprobs_field`, or `type: axolotl.integrations.kd.chat_template`) "
        "or from `kd_teacher_model`. Default: on when `plugins` lists `axolotl.integrations.kd.KDPlugin`, else off. See "
        "docs/distillation.md.",
    )
    kd_alpha: Float = Field(1.0, ge=0, description="With `kd_trainer`: the weight of the distillation (KL) loss.")
    kd_ce_alpha: Float = Field(
        0.0, ge=0, description="With `kd_trainer`: the weight of the cross-entropy on the data's own tokens."
    )
    kd_temperature: Float = Field(
        1.0,
        gt=0,
        description="With `kd_trainer`: the temperature T of both distributions. The student's logits are divided by "
        "T; the teacher's top-k probabilities, given at the dataset's `temperature` T0, are rescaled to T "
        "(p^(T0/T), renormalised over the top-k). The loss is not multiplied by T^2 (as Axolotl's plugin).",
    )
    kd_beta: Float = Field(
        0.0,
        ge=0,
        le=1,
        description="With `kd_trainer`: which divergence: 0 forward KL(teacher || student), 1 reverse KL(student || "
        "teacher), in between the generalised Jensen-Shannon divergence with this weight on the teacher.",
    )
    kd_normalize_topk: bool = Field(
        False,
        description="With `kd_trainer`: renormalise the student's probabilities over the teacher's top-k tokens "
        "(a softmax over those k logits) instead of taking them from the softmax over the whole vocabulary.",
    )
    kd_top_k_before_softmax: bool = Field(
        False,
        description="With `kd_trainer`: older Axolotl's name for the same choice as `kd_normalize_topk`: the "
        "student's softmax runs over the teacher's top-k logits only.",
    )
    kd_zscore_base_temp: Float | None = Field(
        None,
        gt=0,
        description="With `kd_trainer`: logit standardisation: the teacher's top-k log-probabilities and the "
        "student's top-k logits (at `kd_temperature`) are each z-scored over the k tokens and divided by this base "
        "temperature before the softmax and the KL.",
    )
    kd_teacher_model: PathText | None = Field(
        None,
        description="With `kd_trainer`: online distillation from this teacher (a hub id or a directory), loaded in "
        "the same process in inference mode; it gives the top-`kd_online_topk` targets batch by batch. It must use "
        "the student's tokenizer (the same vocabulary); the datasets then carry no `logprobs_field`.",
    )
    kd_online_topk: Int = Field(
        64,
        ge=1,
        description="With `kd_teacher_model`: how many of the teacher's most likely tokens per position are the "
        "target (at most the vocabulary).",
    )
    kd_fused_loss: bool | None = Field(
        None,
        description="With `kd_trainer`: compute the student's logits and the loss a chunk of positions at a time "
        "from its last hidden states (and an online teacher's top-k the same way), so the [tokens x vocabulary] "
        "logits never exist at once; only positions whose next token is trained are projected. The same loss to "
        "float rounding. Default: on when training on a GPU (unless FSDP2, ZeRO-3 or an adapter on `lm_head` "
        "rules it out, or a model's logits are more than its output layer's, which a two-token forward checks "
        "before training), off on CPU. See docs/distillation.md.",
    )
