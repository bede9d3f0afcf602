"""Config keys that change the training loss itself (not how fast it is computed: that is `kernels.py`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hellbender.config.values import Float, Int

EAFT_TUNING_KEYS = ("eaft_alpha", "eaft_k")


class LossSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_eaft: bool = Field(
        False,
        description="Entropy-aware focal training: weight each trained token's cross-entropy by the entropy of the "
        "softmax over its `eaft_k` largest logits, raised to `eaft_alpha` (the weights carry no gradient), so tokens "
        "the model is already sure of count less. The loss is still divided by the trained tokens of the whole "
        "accumulated batch; evaluation loss is weighted the same way. Needs the logits: not with "
        "`liger_fused_linear_cross_entropy` / `cut_cross_entropy`.",
    )
    eaft_alpha: Float = Field(
        1.0,
        ge=0,
        description="With `use_eaft`: the exponent of the entropy weight; 0 gives plain cross-entropy, larger values "
        "favour uncertain tokens more.",
    )
    eaft_k: Int = Field(
        20,
        ge=2,
        description="With `use_eaft`: how many of the largest logits the entropy is computed over (at most the "
        "vocabulary; the weight then ranges from 0 to ln(k)^alpha). At least 2: over one logit the entropy is always "
        "0.",
    )
