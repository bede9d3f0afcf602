"""Online RL's rollout (`rl: grpo`, `gdpo`, `rloo`): the memory and time of the `generate` call that makes the
completions of the next `gradient_accumulation_steps` micro-batches, as TRL 1.16 runs it with hellbender's settings.

One call generates every completion those micro-batches train on, G = `micro_batch_size` x gradient accumulation rows
per GPU (TRL's `steps_per_generation` is the accumulation), each a prompt of P tokens and a completion of C
(`trl.max_completion_length`: every completion planned that long), once every `trl.num_iterations` optimizer steps.
It runs between optimizer steps, when no gradients and no training activations exist.

Memory beside the weights, the adapter and the optimizer states:
- the key-value cache: 2 x G x (P + C - 1) positions (the last token sampled is never fed back) x the key-value
  width per layer in the run's dtype; a sliding-window layer holds at most its window, a layer reading another
  layer's keys and values holds none. Compiled generation allocates it whole at the start (a static cache); eager
  decoding grows to it (its sliding-window layers hold one position fewer). A CPU test checks it against the caches
  `generate` returns, to the byte.
- one layer's keys and values repeated to every query head: transformers repeats them for SDPA when it is given a
  mask, which a static cache always is (2 x G x (P + C - 1) x the query width).
- the larger of the prefill's moment (one layer's forward without gradients over G rows x 64 positions read at a
  time compiled, or the whole prompts eager: `activations.no_grad_layer_bytes`) and sampling's (the last position's
  logits in the run's dtype, their float32 copy, the probabilities and multinomial's draw: 12 bytes more per logit).

Time: the prefill is its FLOPs at the card's efficiency or its forwards' kernel launches, whichever is longer; then
C - 1 decoding steps, one token per row each. A decoding step reads every weight and the cache, and writes and reads
the repeated keys and values, at `DECODE_BANDWIDTH_SHARE` of the card's memory bandwidth, and each of its kernels
costs at least `DECODE_GPU_KERNEL_SECONDS` on the GPU. Compiled, the host adds `DECODE_HOST_KERNEL_SECONDS` per
kernel that it does not hide (each token waits for the one before); eager, the host's launches
(`EAGER_DECODE_KERNEL_SECONDS` per kernel) are the floor. The constants are fitted to profiles of compiled decoding on one H200 (docs/plan.md,
"Online RL")."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from hellbender.config.rl import PREFILL_CHUNK_TOKENS
from hellbender.plan.activations import no_grad_layer_bytes
from hellbender.plan.cards import LAUNCH_SECONDS, Card
from hellbender.plan.model_facts import ModelFacts
from hellbender.plan.settings import PlanSettings

# Fitted to compiled decoding of the Llama-3.2-1B shape at 16 and 64 rows and the Llama-3-8B shape at 32 rows, with
# LoRA r16 on every linear layer, 256 + 256 positions, profiled on one H200 (bench/grpo_generation.py --profile): the
# GPU's busy time per token is the traffic at this share of the bandwidth plus this much per kernel (within 0.94-1.04
# of the three); the host's share, from the same W6 call unprofiled (2.34 s for 64 rows).
DECODE_BANDWIDTH_SHARE = 0.70
DECODE_GPU_KERNEL_SECONDS = 3.2e-6
DECODE_HOST_KERNEL_SECONDS = 3.2e-6
# Eager decoding's host time per kernel: no autograd records anything in a forward without gradients, so it is
# below training's `LAUNCH_SECONDS`. The geometric mean of five decoding measurements of the 1B shape on H200
# machines (docs/plan.md, "The launch floor"): 24-44 us.
EAGER_DECODE_KERNEL_SECONDS = 32e-6
# Compiled decoding launched 742 kernels per token for the 1B model and 1,526 for the 8B, 0.66 and 0.69 of the
# eager forward's count (`launches.py`: 1,123 and 2,227): the compiler fuses the elementwise work.
COMPILED_KERNEL_SHARE = 0.67
# Sampling's bytes per logit beyond the model's own: the float32 copy, the probabilities and multinomial's draw.
_SAMPLING_BYTES = 12


@dataclass(frozen=True)
class RolloutMemory:
    rows: int  # completions generated in one call, per GPU
    positions: int  # the prompt and the completion but its last token: what the cache holds per row
    kv_cache: int
    repeated_kv: int  # one layer's keys and values repeated to every query head
    prefill: int  # the prefill's largest moment, one layer
    sampling: int  # the last position's logits and what sampling makes of them
    element: int  # bytes per value of the cache (the run's dtype)

    @property
    def transient(self) -> int:
        return self.repeated_kv + max(self.prefill, self.sampling)

    @property
    def total(self) -> int:
        return self.kv_cache + self.transient


@dataclass(frozen=True)
class RolloutTime:
    prefill_seconds: float
    decode_steps: int
    seconds_per_token: float  # one decoding step over every row
    kernels_per_token: float

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_steps * self.seconds_per_token


def rollout_rows(s: PlanSettings, gradient_accumulation: int) -> int:
    return s.micro_batch_size * gradient_accumulation


def _cached_length(facts: ModelFacts, layer: int, positions: int) -> int:
    window = facts.window(layer)
    return min(positions, window) if window else positions


def kv_cache_bytes(facts: ModelFacts, rows: int, positions: int, element: int) -> int:
    """The keys and values every layer that holds its own caches for `rows` rows of `positions` positions."""
    return sum(
        2 * rows * _cached_length(facts, layer, positions) * facts.kv_width(layer) * element
        for layer in range(facts.layers)
        if layer not in facts.kv_shared_layers
    )


def _repeated_kv_bytes(facts: ModelFacts, layer: int, rows: int, positions: int, element: int) -> int:
    q, kv = facts.q_width(layer), facts.kv_width(layer)
    return 2 * rows * _cached_length(facts, layer, positions) * q * element if q > kv else 0


def rollout_memory(facts: ModelFacts, s: PlanSettings, element: int, gradient_accumulation: int) -> RolloutMemory:
    rollout = s.method.rollout
    assert rollout is not None
    rows, prompt = rollout_rows(s, gradient_accumulation), s.method.prompt(s.sequence_len)
    positions = prompt + rollout.completion_len - 1  # the last token sampled is never fed back
    prefill_tokens = rows * (min(prompt, PREFILL_CHUNK_TOKENS) if rollout.compiled else prompt)
    return RolloutMemory(
        rows=rows,
        positions=positions,
        kv_cache=kv_cache_bytes(facts, rows, positions, element),
        repeated_kv=max(
            (_repeated_kv_bytes(facts, i, rows, positions, element) for i in range(facts.layers)), default=0
        ),
        prefill=no_grad_layer_bytes(facts, prefill_tokens, element),
        sampling=rows * facts.vocab * (element + _SAMPLING_BYTES),
        element=element,
    )


def _decode_traffic(facts: ModelFacts, memory: RolloutMemory, weight_bytes: int) -> int:
    """Bytes one decoding step reads and writes: every weight once, each layer's cache, and the repeated keys and
    values written and read back."""
    traffic = weight_bytes + memory.kv_cache
    for layer in range(facts.layers):
        traffic += 2 * _repeated_kv_bytes(facts, layer, memory.rows, memory.positions, memory.element)
    return traffic


def rollout_time(facts: ModelFacts, s: PlanSettings, memory: RolloutMemory, weight_bytes: int, card: Card,
                 eager_kernels: float) -> RolloutTime:  # fmt: skip
    """`eager_kernels`: one forward's kernels without compilation (`flops.forward_kernels`); `weight_bytes`: the
    weights and the adapter as the GPU holds them."""
    rollout = s.method.rollout
    assert rollout is not None
    prompt = memory.positions + 1 - rollout.completion_len
    launch = card.launch_seconds or LAUNCH_SECONDS
    tokens = memory.rows * prompt
    flops = (
        2 * tokens * (facts.decoder_linear_numel + facts.lora_numel) + 2 * tokens * facts.q_dim * prompt * facts.layers
    )
    chunks = ceil(prompt / PREFILL_CHUNK_TOKENS) if rollout.compiled else 1
    prefill = max(flops / (card.bf16_tflops * 1e12 * card.efficiency), chunks * eager_kernels * launch)
    traffic = _decode_traffic(facts, memory, weight_bytes) / (card.hbm_tb_s * 1e12 * DECODE_BANDWIDTH_SHARE)
    if rollout.compiled:
        kernels = COMPILED_KERNEL_SHARE * eager_kernels
        per_token = traffic + kernels * (DECODE_GPU_KERNEL_SECONDS + DECODE_HOST_KERNEL_SECONDS)
    else:
        kernels = eager_kernels
        per_token = max(traffic + kernels * DECODE_GPU_KERNEL_SECONDS, kernels * EAGER_DECODE_KERNEL_SECONDS)
    return RolloutTime(prefill, max(rollout.completion_len - 1, 0), per_token, kernels)
