"""Activation memory: what autograd saves per token in one decoder layer, in the layer's input (checkpointed
layers), and around the loss.

Per token of a Llama-style layer (h hidden, q = heads x head_dim, k = kv heads x head_dim, i intermediate, a bytes
per element of the run's dtype), the tensors saved for backward are, as counted on CPU with saved-tensor hooks
(tests/test_plan.py checks the count against a real forward):
- each RMSNorm: its float32 input (4h; Liger's kernel: its input, a h), and its output when the norm's weight
  trains (a h, full fine-tuning);
- the attention input (a h, shared by q, k and v), rotated q and k with v (a (q + 2k)), the attention output (a q,
  shared with o_proj's input); eager attention adds the probabilities: heads x row x (4 + a) per token; shared-
  prompt DPO rows under the varlen kernel save k and v expanded to every query head (2 a (q - k) more);
- the MLP input (a h), SiLU's input, its output and the up projection (3 a i; Liger's SwiGLU recomputes the
  activation: 2 a i) and down_proj's input (a i);
- LoRA on an unquantized base: its float32 adapters make PEFT cast each wrapped input, so the attention input, the
  attention output and the MLP input are saved once more (a each; measured: the MLP inner input is not), plus the
  rank-sized intermediate of each module. On a 4- or 8-bit base PEFT skips that cast under autocast. LoRA dropout
  adds its output and mask (a + 1 per input element) per wrapped module.
- `tiled_mlp`: the MLP runs without a graph and saves only its input (a h); its LoRA modules save nothing. Its
  backward recomputes one shard of the sequence at a time (`tiled_mlp_backward_bytes`).
"""

from __future__ import annotations

from hellbender.models.tiled_mlp import shard_count
from hellbender.plan.fused_loss_time import chunk_positions
from hellbender.plan.method import FUSED_HEAD, SCORE_HEAD
from hellbender.plan.model_facts import ModelFacts
from hellbender.plan.settings import PlanSettings

_LORA_COPIED = ("attention input", "attention output", "MLP input")
_MLP_INPUTS = ("MLP input", "MLP inner")  # LoRA inputs inside the MLP (`tiled_mlp` saves none of them)
# Bytes per logit at the loss's peak without a fused loss: the bf16 logits the model returns, their float32 copy's
# log-softmax (4), its gradient (4), the gradient of the float32 copy (2 more in its cast back) and the bf16 gradient (a): 12 for bf16. Fits W1 and W2's measured
# peaks in docs/benchmarks.md to 3%.
_LOGIT_BYTES_BEYOND_DTYPE = 10
# Liger's fused linear cross-entropy: logits exist for one chunk of tokens at a time (float32, with its gradient),
# and the gradient of the hidden states for all tokens. Planned at 1,024 tokens a chunk (fitted to W1's and W2's
# peaks) or Liger's own chunk where `fused_cross_entropy_chunk_scale` makes it larger.
_FUSED_CHUNK_TOKENS = 1024
# TRL's fused LM head (trl/kernels/chunked_logprob.py, `add_fused_lm_head`): one tile of at most 4,096 tokens x 32,768
# vocabulary entries in the compute dtype at a time.
TRL_TILE_TOKENS, TRL_TILE_VOCAB = 4096, 32768


def layer_bytes_per_token(
    facts: ModelFacts, s: PlanSettings, element: int, norm_trains: bool, layer: int | None = None
) -> float:
    """Bytes saved for backward per token by one decoder layer that is not checkpointed: decoder layer `layer` by its
    own widths, or an average layer."""
    h, i = facts.hidden, facts.intermediate
    q, k = facts.q_dim, facts.kv_dim
    extra_norms = 0
    if layer is not None and layer < len(facts.layer_widths):
        widths = facts.layer_widths[layer]
        q, k, i, extra_norms = widths.q, widths.kv, widths.inner, widths.extra_norms
    a = element
    norm = a * h if s.liger_rms_norm else 4 * h
    if norm_trains:
        norm += a * h
    attention = norm + a * h + a * (q + 2 * k) + a * q
    if s.method.shared_prompt and not s.eager_attention and k < q:
        # Shared-prompt DPO rows go through torch's varlen attention kernel, which torch 2.11 gives no grouped-query
        # option: it is given one key-value head per query head (train/shared_prompt.py) and saves the expanded ones.
        attention += 2 * a * (q - k)
    mlp = norm + a * h
    if not s.tiled_mlp:
        mlp += (2 if s.liger_glu else 3) * a * i + a * i
    lora = 0.0
    for inp in facts.lora_inputs:
        if s.tiled_mlp and inp.group in _MLP_INPUTS:
            continue
        if s.quantized_bits is None and inp.group in _LORA_COPIED:
            lora += a * inp.width
        lora += a * inp.rank_sum * 2  # A's output and its (scaled) copy into B
        if facts.lora_dropout > 0:
            lora += inp.modules * (a + 1) * inp.width
    # Norms beyond the two above (Gemma's after attention and after the MLP, per-head q and k norms): each saves its
    # float32 input.
    return attention + mlp + lora + 4 * extra_norms


def tiled_mlp_backward_bytes(facts: ModelFacts, s: PlanSettings, element: int, norm_trains: bool) -> float:
    """`tiled_mlp`'s backward in one layer, beyond what the layer saved: one shard recomputed with its graph (what
    an untiled MLP saves, for the shard's tokens), and the input gradients of the shards done, gathered into one
    tensor at the end (the list and the joined copy: two of the stream's width at that moment)."""
    if not s.tiled_mlp:
        return 0.0
    untiled = s.but(tiled_mlp=False)
    mlp_per_token = max(
        layer_bytes_per_token(facts, untiled, element, norm_trains, layer)
        - layer_bytes_per_token(facts, s, element, norm_trains, layer)
        for layer in range(max(facts.layers, 1))
    )
    shard_tokens = s.rows * -(-s.row_len // shard_count(s.row_len, facts.hidden, s.tiled_mlp_shards))
    gradients = element * facts.hidden * s.tokens
    return gradients + max(shard_tokens * mlp_per_token, gradients)


def eager_scores(facts: ModelFacts, s: PlanSettings) -> int:
    """Attention scores one layer builds for one micro-batch under eager attention (flash and SDPA kernels build
    none): every query against the whole row of keys, in sliding-window layers too, since eager attention applies the
    window as a mask on the full matrix."""
    return s.rows * facts.heads * s.row_len * s.row_len if s.eager_attention else 0


def attention_scores_bytes(facts: ModelFacts, s: PlanSettings, element: int) -> float:
    """Eager attention's saved probabilities for one layer and one micro-batch: the float32 softmax output, and its
    copy in the run's dtype that multiplies the values (none in float32)."""
    return eager_scores(facts, s) * (4 + (element if element < 4 else 0))


def checkpoint_input_bytes_per_token(facts: ModelFacts, element: int) -> int:
    """A checkpointed layer keeps only its input: the residual stream in the run's dtype."""
    return element * facts.hidden


def loss_bytes(facts: ModelFacts, s: PlanSettings, element: int) -> float:
    """Peak bytes of the logits and loss for one micro-batch."""
    tokens = s.tokens
    if s.method.head == SCORE_HEAD:  # one score per token (`num_labels` 1), float32 with its gradient
        return tokens * (element + 8)
    if s.method.head == FUSED_HEAD:
        return fused_head_bytes(facts, s.scored_tokens, element)
    if s.fused_loss:
        chunk = min(
            tokens, max(_FUSED_CHUNK_TOKENS, chunk_positions(tokens, facts.vocab, facts.hidden, s.loss_chunk_scale))
        )
        return chunk * facts.vocab * 8 + tokens * facts.hidden * (element + 4)
    # Final logit soft-capping (cap x tanh(logits / cap)) keeps tanh's output for backward: one more logit each.
    softcap = element if facts.logit_softcapping else 0
    return tokens * facts.vocab * (element + _LOGIT_BYTES_BEYOND_DTYPE + softcap)


def per_layer_inputs_bytes(facts: ModelFacts, tokens: int, element: int) -> int:
    """Gemma's per-layer inputs, made for every layer before the first one and alive until backward reaches the
    model's start: the combined tensor in the run's dtype (each layer saves its slice, or a checkpoint keeps it), and
    what their projection's RMSNorm saves, which computes in float32 whatever the run's dtype: its float32 input (and
    its normalized output where the norm trains) and two float32 statistics per layer and token."""
    if not facts.per_layer_inputs:
        return 0
    norm = 4 * facts.per_layer_inputs * (1 + facts.per_layer_inputs_norm_trains) + 2 * 4 * facts.layers
    return tokens * (element * facts.per_layer_inputs + norm)


def fused_head_bytes(facts: ModelFacts, scored: int, element: int) -> float:
    """Peak bytes of TRL's fused LM head over `scored` answer tokens in backward: the answer tokens' hidden states it
    saved (a copy, gathered by the label mask), their float32 gradient accumulator and its cast back, one tile of
    logits, and a trained head's float32 weight-gradient accumulator."""
    tile = min(scored, TRL_TILE_TOKENS) * min(facts.vocab, TRL_TILE_VOCAB) * element
    hidden = scored * facts.hidden * (element + 4 + element)
    weight_gradient = 4 * facts.head_numel if facts.head_trainable else 0
    return tile + hidden + weight_gradient


def no_grad_layer_bytes(facts: ModelFacts, tokens: int, element: int) -> int:
    """One decoder layer's largest moment in a forward without gradients, where nothing is saved: the residual stream
    and its normed copy, the MLP's up projection, activation and product."""
    return tokens * (2 * element * facts.hidden + 3 * element * facts.intermediate)


def reference_forward_bytes(facts: ModelFacts, s: PlanSettings, element: int) -> float:
    """Peak transient bytes of a forward without gradients over the micro-batch's rows (the reference, KTO's KL
    rows): one layer's largest moment (`no_grad_layer_bytes`), or the fused head's moment (the last hidden states,
    the answer tokens' copy and one tile)."""
    tokens = s.tokens
    layer = no_grad_layer_bytes(facts, tokens, element)
    scored = s.scored_tokens
    tile = min(scored, TRL_TILE_TOKENS) * min(facts.vocab, TRL_TILE_VOCAB) * element
    head = tokens * element * facts.hidden + scored * element * facts.hidden + tile
    return max(layer, head)
