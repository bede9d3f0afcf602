"""What one micro-batch runs under the config's training method, as TRL 1.16's trainers run it (train/methods/):
the rows that go forward and backward through the policy, how their answers are scored, and what runs beside them
without gradients.

- Supervised fine-tuning: `micro_batch_size` rows of `sequence_len` tokens, full logits and the loss (or Liger's
  fused loss).
- DPO / IPO: B pairs are 2B rows (every prompt + chosen row, then every prompt + rejected row), or, with the prompt
  shared (`dpo_shared_prompt`), B rows of prompt + chosen + rejected + 1 tokens. TRL's fused LM head projects only
  the answer tokens, in tiles, and never holds the full logits. A reference forward without gradients runs over the
  same rows after the policy's forward, whose saved activations are still alive: the base with the adapter switched
  off (no extra weights), or for full fine-tuning a frozen copy of the starting weights; nothing with
  `precompute_ref_log_probs`.
- KTO: B unpaired rows; its KL term scores each prompt with another row's answer, once on the policy (no gradients)
  and once on the reference, beside the reference forward of the rows.
- ORPO / SimPO: 2B rows, no reference; TRL's older trainers take the full logits of every row.
- Reward model: 2B rows through a sequence-classification head (one score per token, no vocabulary logits).
- Knowledge distillation (`kd_trainer`, train/distillation.py): B rows through the student, scored by the
  distillation loss over its whole logits or, with `kd_fused_loss` (on by default on a GPU), a chunk of positions at
  a time from its last hidden states. The teacher's top-k targets (ids, log-probabilities, mask) come with the rows, or
  from a teacher model (`kd_teacher_model`) that runs a forward without gradients over the same rows before the
  student's forward, when none of the student's activations of this micro-batch exist yet.

- Online RL (`rl: grpo`, `gdpo`, `rloo`; TRL's GRPOTrainer and RLOOTrainer): B completions per micro-batch, each a
  row of its prompt and the completion, scored by TRL's fused LM head over the completion tokens. Every
  `trl.num_iterations` optimizer steps the model first generates the next step's completions (`generation.py`), and
  the reference (with `trl.beta` > 0) and, with several iterations, the policy score them without gradients, B rows
  at a time, before any training activations exist.

Rows are planned at their worst case, `sequence_len` tokens each; a pair's prompt is `max_prompt_len` tokens where
the config sets it, else a single token (the longest answers), and its answers fill the rest of `sequence_len`. Online
RL's prompts are not cut: a row is planned as `sequence_len` tokens of which the completion is
`trl.max_completion_length` (every completion as long as it may be), so `sequence_len` stands for the longest prompt
plus that."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hellbender.config import HellbenderConfig
from hellbender.config.preference import REFERENCE_METHODS

if TYPE_CHECKING:
    from hellbender.plan.model_facts import ModelFacts

# How the policy's rows are scored. Distillation's loss: over the whole logits, or a chunk of positions at a time.
LOGITS, FUSED_HEAD, SCORE_HEAD = "logits", "fused", "score"
KD_LOGITS, KD_CHUNKED = "distillation logits", "distillation chunks"
# The teacher's targets of knowledge distillation: computed by a teacher model, or stored with the rows.
TEACHER_MODEL, STORED_TARGETS = "teacher model", "stored targets"
_PAIRS = ("dpo", "ipo", "orpo", "simpo")
_NAMES = {"dpo": "DPO", "ipo": "IPO", "kto": "KTO", "orpo": "ORPO", "simpo": "SimPO"}


@dataclass(frozen=True)
class Rollout:
    """Online RL's generation, as TRL runs it with hellbender's settings: one `generate` call over every completion
    of `steps_per_generation` (= gradient accumulation) micro-batches, every `iterations` optimizer steps."""

    completion_len: int  # `trl.max_completion_length`: every completion planned this long
    generations: int  # `trl.num_generations`: completions per prompt
    iterations: int  # `trl.num_iterations`: optimizer steps trained on each generation
    compiled: bool  # `trl.compile_generation` on a GPU: static cache, compiled decoding, chunked prefill


@dataclass(frozen=True)
class MethodShape:
    name: str = "supervised fine-tuning"
    example: str = "row"  # what one of `micro_batch_size` is: a row, or a pair (of a chosen and a rejected answer)
    rows_per_example: int = 1  # rows through the policy with gradients per example (TRL's pairs: 2)
    shared_prompt: bool = False  # a pair in one row: prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected
    prompt_len: int | None = None  # a pair's (or KTO row's) prompt as planned; None: one token
    head: str = LOGITS  # LOGITS, FUSED_HEAD (TRL's chunked head over answer tokens), SCORE_HEAD, KD_LOGITS, KD_CHUNKED
    reference: str | None = None  # "adapter off", "frozen copy" or "precomputed"; None: no reference model
    kl_rows: bool = False  # KTO's KL rows: one more forward without gradients on the policy and on the reference
    teacher: str | None = None  # distillation: TEACHER_MODEL or STORED_TARGETS
    top_k: int = 0  # distillation: the teacher's targets per token
    ce_gradient: bool = False  # distillation with `kd_ce_alpha` > 0: the cross-entropy's log-softmax kept for backward
    rollout: Rollout | None = None  # online RL: the generation before training (its reference scores the rollout)

    @property
    def distills(self) -> bool:
        return self.head in (KD_LOGITS, KD_CHUNKED)

    @property
    def online(self) -> bool:
        return self.rollout is not None

    @property
    def answers_per_example(self) -> int:
        return 2 if self.example == "pair" else 1

    @property
    def reference_copy(self) -> bool:
        """A frozen copy of the starting weights stays on the GPU beside the policy."""
        return self.reference == "frozen copy"

    @property
    def reference_forwards(self) -> int:
        """Forwards without gradients over the micro-batch's rows on the reference, per micro-batch."""
        if self.reference in (None, "precomputed"):
            return 0
        return 2 if self.kl_rows else 1

    @property
    def policy_forwards_without_grad(self) -> int:
        """KTO's KL rows through the policy, without gradients (kept with precomputed reference scores too)."""
        return 1 if self.kl_rows else 0

    def prompt(self, sequence_len: int) -> int:
        return max(1, min(self.prompt_len or 1, sequence_len - 1))

    def answer(self, sequence_len: int) -> int:
        """Tokens of one answer: what its row leaves after the prompt."""
        return sequence_len - self.prompt(sequence_len)

    def row_len(self, sequence_len: int) -> int:
        if self.shared_prompt:
            return self.prompt(sequence_len) + 2 * self.answer(sequence_len) + 1
        return sequence_len

    def rows(self, micro_batch: int) -> int:
        return micro_batch * (1 if self.shared_prompt else self.rows_per_example)

    def tokens(self, micro_batch: int, sequence_len: int) -> int:
        """Tokens through the policy (with gradients) per micro-batch; each reference forward runs the same."""
        return self.rows(micro_batch) * self.row_len(sequence_len)

    def scored_tokens(self, micro_batch: int, sequence_len: int) -> int:
        """Answer tokens TRL's fused head projects per micro-batch (the full-logits head projects every token)."""
        if self.head != FUSED_HEAD:
            return self.tokens(micro_batch, sequence_len)
        return micro_batch * self.answers_per_example * self.answer(sequence_len)

    def mean_context(self, sequence_len: int) -> float:
        """Keys each query of a row attends to on average under full attention (causal: half the row). A shared row's
        answers see the prompt and themselves, never each other."""
        length = self.row_len(sequence_len)
        if not self.shared_prompt:
            return length / 2
        p, a = self.prompt(sequence_len), self.answer(sequence_len)
        return (p * p / 2 + 2 * (a * p + a * a / 2)) / length


SUPERVISED = MethodShape()


def method_shape(cfg: HellbenderConfig, facts: ModelFacts | None = None) -> MethodShape:
    """The shape of `cfg`'s method. `facts` (of the model `cfg` trains) decide whether DPO pairs share their prompt;
    without them the meta model is built."""
    if cfg.reward_model:
        return MethodShape(name="reward model", example="pair", rows_per_example=2, head=SCORE_HEAD)
    method = cfg.rl
    if method is None:
        if cfg.distills:
            return MethodShape(
                name="knowledge distillation",
                head=KD_CHUNKED if chunked_distillation(cfg) else KD_LOGITS,
                teacher=TEACHER_MODEL if cfg.kd_teacher_model else STORED_TARGETS,
                top_k=cfg.kd_online_topk,
                ce_gradient=cfg.kd_ce_alpha > 0,
            )
        return SUPERVISED
    if method not in _NAMES:  # grpo, gdpo, rloo
        return _online_shape(cfg)
    reference = None
    if method in REFERENCE_METHODS:
        reference = "precomputed" if cfg.precompute_ref_log_probs else "adapter off" if cfg.adapter else "frozen copy"
    return MethodShape(
        name=_NAMES[method],
        example="pair" if method in _PAIRS else "row",
        rows_per_example=2 if method in _PAIRS else 1,
        shared_prompt=method in ("dpo", "ipo") and _shares_prompts(cfg, facts),
        prompt_len=cfg.max_prompt_len,
        head=FUSED_HEAD if method in REFERENCE_METHODS else LOGITS,
        reference=reference,
        kl_rows=method == "kto",
    )


def _online_shape(cfg: HellbenderConfig) -> MethodShape:
    """GRPO / GDPO / RLOO: completions as rows through the fused head, after a rollout; the reference with `beta` > 0."""
    trl = cfg.trl
    assert trl is not None  # an online method without it is refused at validation
    compiled = trl.compile_generation
    if compiled is None:  # as training decides on a GPU (train/methods/online.py's `compiled_generation`)
        from hellbender.config.rl_checks import compiled_generation_blocker

        compiled = compiled_generation_blocker(cfg) is None
    reference = None
    if trl.beta:
        reference = "adapter off" if cfg.adapter else "frozen copy"
    completion = trl.max_completion_length
    return MethodShape(
        name={"grpo": "GRPO", "gdpo": "GDPO", "rloo": "RLOO"}[cfg.rl or ""],
        example="completion",
        prompt_len=max(1, cfg.sequence_len - completion),
        head=FUSED_HEAD,
        reference=reference,
        rollout=Rollout(completion, trl.num_generations, trl.num_iterations, compiled),
    )


def chunked_distillation(cfg: HellbenderConfig) -> bool:
    """As training decides on a GPU (train/distillation.py's `fused_distillation`): `kd_fused_loss`, or unset, on
    unless the config rules it out. The student's loss and an online teacher's top-k follow the same key."""
    from hellbender.config.distillation_checks import fused_loss_blocker

    return cfg.kd_fused_loss if cfg.kd_fused_loss is not None else fused_loss_blocker(cfg) is None


def _shares_prompts(cfg: HellbenderConfig, facts: ModelFacts | None) -> bool:
    """As training decides (train/methods/dpo.py) on a GPU: `dpo_shared_prompt: true` shares, `false` does not;
    unset shares on a text model that can where it pays. Pairs with images keep two rows."""
    if cfg.dpo_shared_prompt is False or cfg.is_multimodal:
        return False
    if cfg.dpo_shared_prompt:
        return True
    from hellbender.models.pair_layout import shared_by_default

    if facts is None:
        from hellbender.plan.model_facts import describe, meta_model

        facts = describe(cfg, meta_model(cfg))
    sixteen_bit = cfg.bf16 is not False or bool(cfg.fp16)  # the weights' precision on a GPU
    return facts.shared_prompt_refusal is None and shared_by_default(facts.attention, True, sixteen_bit)
