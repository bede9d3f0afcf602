"""DPO pairs scored in one row that holds their prompt once (`dpo_shared_prompt`).

TRL's DPOTrainer scores a batch of B pairs as 2B rows, every `prompt + chosen` row and then every `prompt + rejected`
row, so each prompt runs through the policy (forward, recomputation, backward) and through the reference twice. Here
the model's forward receives that same batch and runs it as B rows of

    prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected

The prompt's last token heads each answer, so that each answer's first token is predicted from it under the usual
one-token shift of the labels. The positions of each answer continue from the prompt's end (the rejected answer's
restart there), and the attention mask lets each answer see the prompt and itself, never the other answer. Every scored
token therefore sees the same tokens at the same positions as in TRL's rows, and its log-probability is the same up to
float rounding (tests/test_dpo_shared_prompt.py). A pair of a 1,024-token prompt and two 1,024-token answers runs 3,073
tokens instead of 4,096.

The per-token outputs of the fused LM head (TRL's `add_fused_lm_head`) are put back in TRL's 2B-row layout, so TRL's
loss and metrics run unchanged. The mask is a flex-attention block mask on CUDA (the compiled kernel skips blocks that
are wholly masked, so the rejected answer costs nothing against the chosen one) and a dense boolean mask elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hellbender.errors import ConfigError
from hellbender.models.pair_layout import shared_by_default, why_model_not_shared

IGNORE_INDEX = -100
# What each token of a shared row is; padding sees only itself (a query that sees nothing gives NaN under SDPA).
PROMPT, CHOSEN, REJECTED, PADDING = 0, 1, 2, 3
# The per-token fields of TRL's fused LM head output, shaped like the labels shifted by one.
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class SharedPromptRows:
    """B pairs as B rows with the prompt once. `segments`: PROMPT / CHOSEN / REJECTED / PADDING per token;
    `chosen_scored`, `rejected_scored`: where, among the shifted per-token outputs, a chosen (rejected) answer token is
    predicted, in answer order; `pair_scored`: the same places in TRL's 2B rows (its labels shifted by one)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    labels: torch.Tensor
    chosen_scored: torch.Tensor
    rejected_scored: torch.Tensor
    pair_scored: torch.Tensor

    def to_pair_rows(self, shared: torch.Tensor) -> torch.Tensor:
        """A per-token output of the shared rows (B, T - 1) in TRL's layout (2B, L - 1): chosen rows, then rejected
        rows, zero where nothing is scored. Differentiable: each value keeps its gradient path."""
        pairs = self.chosen_scored.shape[0]
        chosen_place, rejected_place = self.pair_scored[:pairs], self.pair_scored[pairs:]
        chosen = shared.new_zeros(chosen_place.shape).masked_scatter(chosen_place, shared[self.chosen_scored])
        rejected = shared.new_zeros(rejected_place.shape).masked_scatter(rejected_place, shared[self.rejected_scored])
        return torch.cat([chosen, rejected])


def share_prompts(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> SharedPromptRows:
    """The shared rows of a TRL pair batch: `input_ids` (2B, L) are B `prompt + chosen` rows then B `prompt +
    rejected` rows, right-padded; `labels` are the ids where an answer token is, -100 elsewhere. Raises ValueError when
    the batch is not such pairs (a pair whose rows differ in the prompt, an answer that does not end its row, an empty
    prompt)."""
    pairs = input_ids.shape[0] // 2
    scored = labels != IGNORE_INDEX
    lengths = attention_mask.sum(dim=1)
    answer_lengths = scored.sum(dim=1)
    prompt_lengths = lengths - answer_lengths
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    is_answer = (index >= prompt_lengths[:, None]) & (index < lengths[:, None])
    in_prompt = index < prompt_lengths[:pairs, None]
    same_prompt = (input_ids[:pairs] == input_ids[pairs:]) | ~in_prompt
    checks = torch.stack(
        [
            torch.all(prompt_lengths[:pairs] == prompt_lengths[pairs:]),
            torch.all(scored == is_answer),
            torch.all(same_prompt),
            torch.all(prompt_lengths >= 1),
        ]
    )
    if input_ids.shape[0] != 2 * pairs or not bool(checks.all()):
        raise ValueError(
            "a DPO batch whose rows are not pairs of one prompt followed by their answers reached the shared-prompt "
            "scoring; set `dpo_shared_prompt: false`"
        )
    rows = []
    for pair, (prompt, chosen, rejected) in enumerate(
        zip(
            prompt_lengths[:pairs].tolist(),
            answer_lengths[:pairs].tolist(),
            answer_lengths[pairs:].tolist(),
            strict=True,
        )
    ):
        chosen_ids = input_ids[pair, prompt - 1 : prompt + chosen]  # the prompt's last token, then the answer
        rejected_ids = input_ids[pairs + pair, prompt - 1 : prompt + rejected]
        rows.append((input_ids[pair, : prompt - 1], chosen_ids, rejected_ids))
    width = max(sum(part.numel() for part in row) for row in rows)

    def padded(values: list[torch.Tensor], fill: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(v, (0, width - v.numel()), value=fill) for v in values])

    device = input_ids.device
    ids, positions, segments, shared_labels = [], [], [], []
    for prompt_ids, chosen_ids, rejected_ids in rows:
        start = prompt_ids.numel()
        ids.append(torch.cat([prompt_ids, chosen_ids, rejected_ids]))
        positions.append(
            torch.cat(
                [
                    torch.arange(start, device=device),
                    torch.arange(start, start + chosen_ids.numel(), device=device),
                    torch.arange(start, start + rejected_ids.numel(), device=device),
                ]
            )
        )
        segments.append(
            torch.cat(
                [
                    torch.full_like(prompt_ids, PROMPT),
                    torch.full_like(chosen_ids, CHOSEN),
                    torch.full_like(rejected_ids, REJECTED),
                ]
            )
        )
        head = torch.full((start + 1,), IGNORE_INDEX, device=device, dtype=labels.dtype)
        shared_labels.append(torch.cat([head, chosen_ids[1:], head[:1], rejected_ids[1:]]))
    segments_padded = padded(segments, PADDING)
    shared_labels_padded = padded(shared_labels, IGNORE_INDEX)
    # A shifted output at t predicts the token at t + 1.
    next_segment, next_scored = segments_padded[:, 1:], shared_labels_padded[:, 1:] != IGNORE_INDEX
    return SharedPromptRows(
        input_ids=padded(ids, 0),
        position_ids=padded(positions, 0),
        segments=segments_padded,
        labels=shared_labels_padded,
        chosen_scored=next_scored & (next_segment == CHOSEN),
        rejected_scored=next_scored & (next_segment == REJECTED),
        pair_scored=scored[:, 1:],
    )


def visible(segments: torch.Tensor, query: Any, key: Any) -> Any:
    """Whether `query` attends to `key` in a shared row (tensors of token indices, broadcast): causal, and the key
    is the prompt or in the query's own part; padding sees only itself."""
    query_part, key_part = segments[..., query], segments[..., key]
    same_or_prompt = (key_part == PROMPT) | (key_part == query_part)
    return (key <= query) & same_or_prompt & ((key_part != PADDING) | (key == query))


def dense_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean mask for SDPA and eager attention."""
    index = torch.arange(segments.shape[1], device=segments.device)
    rows = [visible(row, index[:, None], index[None, :]) for row in segments]
    return torch.stack(rows)[:, None]


def additive_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense mask as eager attention adds it to the scores: 0 where seen, the dtype's lowest value elsewhere."""
    hidden = ~dense_mask(segments)
    return torch.zeros(hidden.shape, dtype=dtype, device=segments.device).masked_fill_(hidden, torch.finfo(dtype).min)


def block_mask(segments: torch.Tensor) -> Any:
    """The same mask as a flex-attention block mask: blocks no query of which sees any key are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch: Any, head: Any, query: Any, key: Any) -> Any:
        return visible(segments[batch], query, key)

    length = segments.shape[1]
    return create_block_mask(mask_mod, segments.shape[0], None, length, length, device=segments.device)


class SharedPromptForward:
    """Put in front of a model's forward that TRL gave its fused LM head. A call with `fused_lm_head=True` and labels
    (TRL scoring a pair batch, policy or reference) runs the shared rows and returns TRL's output in its own layout;
    every other call passes through."""

    def __init__(self, forward: Callable[..., Any], make_mask: Callable[[torch.Tensor], Any]) -> None:
        self.forward = forward
        self.make_mask = make_mask

    def __call__(self, *args: Any, fused_lm_head: bool = False, labels: Any = None, **kwargs: Any) -> Any:
        if args or not fused_lm_head or labels is None or kwargs.get("input_ids") is None:
            return self.forward(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)
        input_ids, attention_mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask")
        rows = share_prompts(input_ids, labels, attention_mask)
        outputs = self.forward(
            input_ids=rows.input_ids,
            position_ids=rows.position_ids,
            attention_mask=self.make_mask(rows.segments),
            labels=rows.labels,
            fused_lm_head=True,
            **kwargs,
        )
        fields = {name: getattr(outputs, name) for name in outputs.__dataclass_fields__}
        for name in PER_TOKEN_FIELDS:
            if fields[name] is not None:
                fields[name] = rows.to_pair_rows(fields[name])
        fields["label_mask"] = rows.pair_scored
        return type(outputs)(**fields)


SHARED_PROMPT_ATTENTION = "hellbender_shared_prompt_sdpa"


def flex_or_sdpa_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Flex attention (compiled with torch's defaults) where it is given a block mask, transformers' SDPA otherwise."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hellbender.models.flex_attention import compiled_flex

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if kwargs.get("dropout") or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            f"{type(module).__name__} calls attention with dropout, a softcap or sinks, which the shared-prompt "
            "scoring does not apply; set `dpo_shared_prompt: false`"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        # Each key-value head serves `groups` query heads. torch 2.11's compiler cannot build flex attention's
        # grouped-query kernels (see `check_flex_compiles`), so they are given one key-value head per query head.
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = compiled_flex({})(query, key, value, block_mask=attention_mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def register_flex_for_block_masks() -> str:
    """Register `flex_or_sdpa_attention` as an attention implementation, with SDPA's mask builder, so a model loaded
    with SDPA keeps it for every forward but the shared rows'. Returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_PROMPT_ATTENTION, flex_or_sdpa_attention)
    AttentionMaskInterface.register(SHARED_PROMPT_ATTENTION, sdpa_mask)
    return SHARED_PROMPT_ATTENTION


def use_shared_prompts(model: Any, required: bool) -> bool:
    """Score DPO pairs with their prompt once on `model` (the causal LM TRL gave its fused LM head): always when
    `required` (`dpo_shared_prompt: true`; a ConfigError says why a model cannot), else where it pays
    (`pair_layout.shared_by_default`). Returns whether it is on."""
    config = model.config.get_text_config()
    reason = why_model_not_shared(model)
    if reason is not None and required:
        raise ConfigError(
            f"`dpo_shared_prompt: true`: this model's pairs cannot be scored with their prompt once, because "
            f"{reason}. Remove `dpo_shared_prompt` (pairs are then scored as two rows each)."
        )
    on_gpu = next(model.parameters()).device.type == "cuda"
    if reason is not None or not (required or shared_by_default(config._attn_implementation, on_gpu)):
        return False
    model.forward = SharedPromptForward(model.forward, mask_builder(model, config._attn_implementation))
    return True


def mask_builder(model: Any, attention: str) -> Callable[[torch.Tensor], Any]:
    """How the shared rows' mask is given to `attention`: a block mask for flex attention on CUDA (a model loaded with
    SDPA switches to an implementation that keeps SDPA for every other forward), the dense mask elsewhere (eager
    attention adds it to the scores)."""
    if attention == "eager":
        dtype = model.dtype
        return lambda segments: additive_mask(segments, dtype)
    if next(model.parameters()).device.type != "cuda":
        return dense_mask
    if attention == "sdpa":
        model.set_attn_implementation(register_flex_for_block_masks())
    return block_mask
