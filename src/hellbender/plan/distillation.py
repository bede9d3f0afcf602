"""Knowledge distillation's memory, counted from what train/distillation.py, train/distillation_loss.py,
train/fused_distillation_loss.py and train/teacher.py allocate for one micro-batch of N tokens (a bytes per element of
the run's dtype, V the student's vocabulary, k the targets per token).

- The targets: per token k int64 ids, k float32 log-probabilities and k bool mask slots (13 k bytes). The batch's (or
  the teacher's) stay alive through the student's forward and loss, and the loss takes a copy at the trained positions.
- The loss over the whole logits (`kd_fused_loss: false`), per logit at its peak: in the forward the model's logits
  (a), their copy at the trained positions (a), their float32 copy divided by the temperature (4, saved by
  `logsumexp` and `gather`) and `logsumexp`'s temporary (4); then the cross-entropy's float32 copy (4 unless a is 4)
  and its log-softmax (4, saved when `kd_ce_alpha` > 0). In
  backward, the cross-entropy's gradient cast back (a, waiting for the divergence's) beside the saved tensor, the
  gradients `logsumexp` and `gather` give it and their sum (16). Measured on CPU (peak resident bytes, one process per
  case, temperatures 1 and 2): 18.1 bytes per logit in bf16 with `kd_ce_alpha` > 0, 16.2 without, 20.2 in float32
  (all at the backward).
- The chunked loss (`kd_fused_loss: true`): the same per logit, for one chunk of `CHUNK_LOGITS` logits at a time (its
  logits are the model's; no copy at the trained positions), beside the trained positions' hidden states, their
  gradient (a N H each) and a trained head's float32 weight-gradient accumulator (then its cast back, a per weight).
- The teacher's forward (`kd_teacher_model`), before the student's: nothing is saved, so one layer's largest moment is
  alive (the residual stream and its normed copy, the MLP's up projection, activation and product; no KV cache), or
  its head's: the whole logits (a V) and their float32 copy (4 V; cut to the tokenizer's size, planned as the student's
  vocabulary), or with `kd_fused_loss` the last hidden states and one chunk's logits and float32 copy; then the top-k
  targets, their concatenation and their shift onto the tokens they predict.
"""

from __future__ import annotations

from hellbender.plan.activations import no_grad_layer_bytes
from hellbender.plan.method import KD_CHUNKED, KD_LOGITS
from hellbender.plan.model_facts import ModelFacts
from hellbender.plan.settings import PlanSettings

TARGET_SLOT_BYTES = 8 + 4 + 1  # an int64 id, a float32 log-probability, a bool mask slot
_BACKWARD_BYTES_PER_LOGIT = 16  # the saved float32 logits, the gradients of logsumexp and gather, and their sum


def chunk_positions(vocab: int, tokens: int) -> int:
    """Positions per chunk of the chunked loss and the teacher's chunked top-k (`models/output_head.py`)."""
    from hellbender.models.output_head import CHUNK_LOGITS

    return min(tokens, max(1, CHUNK_LOGITS // vocab))


def chunk_count(vocab: int, tokens: int) -> int:
    """How many chunks of positions `tokens` make (`chunk_positions` each, the last one shorter)."""
    return -(-tokens // chunk_positions(vocab, tokens))


def target_bytes(s: PlanSettings) -> int:
    """The teacher's targets alive through the student's forward and loss: those of the micro-batch and the loss's
    copy at the trained positions (all of them, planned at the worst case)."""
    return 2 * s.tokens * s.method.top_k * TARGET_SLOT_BYTES


def bytes_per_logit(element: int, ce_gradient: bool, whole: bool) -> int:
    """Peak bytes per logit of the divergence and the cross-entropy, forward or backward (module docstring). `whole`:
    over the model's logits (copied at the trained positions), else over one chunk's."""
    cast = 4 if element < 4 else 0  # `.float()` of float32 logits is the tensor itself
    model = element if whole else 0  # the model's whole logits, beside their copy at the trained positions
    # The cross-entropy's float32 copy and log-softmax beside the scaled copy (`logsumexp` before it holds the scaled
    # copy and a temporary of its size: no more).
    forward = model + element + cast + 4 + 4
    backward = _BACKWARD_BYTES_PER_LOGIT + (element if ce_gradient else 0)
    return max(forward, backward)


def loss_bytes(facts: ModelFacts, s: PlanSettings, element: int) -> int:
    """Peak transient bytes of the distillation loss of one micro-batch (the targets apart)."""
    shape, tokens, vocab = s.method, s.tokens, facts.vocab
    if shape.head == KD_LOGITS:
        return tokens * vocab * bytes_per_logit(element, shape.ce_gradient, whole=True)
    assert shape.head == KD_CHUNKED
    logits = chunk_positions(vocab, tokens) * vocab
    hidden = 2 * element * tokens * facts.hidden  # the trained positions' hidden states and their gradient
    if not facts.head_trainable:
        return hidden + logits * bytes_per_logit(element, shape.ce_gradient, whole=False)
    accumulator, weight = 4 * facts.head_numel, element * facts.head_numel
    return (
        hidden
        + accumulator
        + max(
            logits * bytes_per_logit(element, shape.ce_gradient, whole=False),
            element * logits + weight,  # a chunk's weight gradient beside its logits' gradient
            weight,  # the accumulator's cast back, saved for backward
        )
    )


def teacher_forward_bytes(teacher: ModelFacts, s: PlanSettings, element: int, vocab: int) -> int:
    """Peak transient bytes of the teacher's forward over the micro-batch and its top-k targets (module docstring);
    `vocab`: the student's, the most target ids the teacher's logits are cut to."""
    tokens, shape = s.tokens, s.method
    cut = min(vocab, teacher.vocab)
    cast = 0 if element == 4 and cut == teacher.vocab else 4  # `.float()` of the cut logits
    layer = no_grad_layer_bytes(teacher, tokens, element)
    targets = tokens * shape.top_k * TARGET_SLOT_BYTES
    if shape.head == KD_CHUNKED:
        chunk = chunk_positions(teacher.vocab, tokens) * (element * teacher.vocab + cast * cut)
        head = element * tokens * teacher.hidden + chunk + 3 * targets  # the chunks' targets, joined, then shifted
    else:  # the forward's logits live until their float32 copy is made
        head = tokens * (element * teacher.vocab + cast * cut) + 2 * targets
    return max(layer, head)
