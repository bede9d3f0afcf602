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
loss and metrics run unchanged. On CUDA in 16-bit precision each layer's attention runs torch's flash-attention varlen
kernel twice, on each row's prompt + chosen part and on its rejected part over the prompt and itself, causal (no
masked block is computed); elsewhere a dense mask goes to SDPA or eager attention.
"""

from __future__ import annotations

import functools
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
    # Per row: tokens of the prompt before its last token, of the chosen part, of the rejected part (each answer
    # headed by the prompt's last token).
    parts: list[tuple[int, int, int]]

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
        parts=[(prompt.numel(), chosen.numel(), rejected.numel()) for prompt, chosen, rejected in rows],
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


@dataclass
class VarlenParts:
    """Where torch's varlen attention kernel finds the shared rows' parts, as flat indices into the [B * T] tokens:
    `first`: each row's prompt (before its last token) and chosen part, one causal sequence each; `rejected`: each
    row's rejected part as queries over `rejected_keys` (that row's prompt, then its rejected part), causal from the
    end, so the rejected part sees the whole prompt and itself. `*_starts`: cumulative sequence starts (int32)."""

    first: torch.Tensor
    first_starts: torch.Tensor
    first_longest: int
    rejected: torch.Tensor
    rejected_starts: torch.Tensor
    rejected_longest: int
    rejected_keys: torch.Tensor
    rejected_key_starts: torch.Tensor
    rejected_keys_longest: int

    @classmethod
    def of(cls, rows: SharedPromptRows) -> VarlenParts:
        width, device = rows.input_ids.shape[1], rows.input_ids.device
        first, rejected, rejected_keys = [], [], []
        for row, (prompt, chosen, rejected_part) in enumerate(rows.parts):
            start = row * width + prompt + chosen
            first.append(torch.arange(row * width, start, device=device))
            rejected.append(torch.arange(start, start + rejected_part, device=device))
            rejected_keys.append(torch.cat([first[-1][:prompt], rejected[-1]]))

        def starts(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.tensor([0] + [p.numel() for p in parts], device=device).cumsum(0, dtype=torch.int32)

        return cls(
            first=torch.cat(first),
            first_starts=starts(first),
            first_longest=max(p.numel() for p in first),
            rejected=torch.cat(rejected),
            rejected_starts=starts(rejected),
            rejected_longest=max(p.numel() for p in rejected),
            rejected_keys=torch.cat(rejected_keys),
            rejected_key_starts=starts(rejected_keys),
            rejected_keys_longest=max(p.numel() for p in rejected_keys),
        )


# The keyword argument that carries `VarlenParts` from the model's forward to each layer's attention call
# (transformers hands a forward's extra keyword arguments down to the attention function).
VARLEN_KEYWORD = "shared_prompt_parts"


@functools.cache
def varlen_parameters() -> frozenset[str]:
    """The keyword names of the installed torch's varlen kernel (read once, not on every attention call)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def causal_varlen(
    query: Any, key: Any, value: Any, starts: tuple[Any, Any], longest: tuple[int, int], scale: float | None
) -> Any:
    """torch's flash-attention varlen kernel, causal and aligned at each sequence's end (with fewer queries than keys,
    query i sees keys up to `keys - queries + i`), in the signature the installed torch has."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = varlen_parameters()
    options: dict[str, Any] = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:  # one key-value head per query head, as grouped-query attention reads them
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return varlen_attn(query, key, value, *starts, *longest, scale=scale, **options)


def shared_prompt_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """The shared rows' attention through the varlen kernel where the forward carries `VarlenParts`, transformers'
    SDPA for every other forward. `query` [B, H, T, D], `key` / `value` [B, H_kv, T, D]; returns [B, T, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    parts: VarlenParts | None = kwargs.pop(VARLEN_KEYWORD, None)
    if parts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if kwargs.get("dropout") or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            f"{type(module).__name__} calls attention with dropout, a softcap or sinks, which the shared-prompt "
            "scoring does not apply; set `dpo_shared_prompt: false`"
        )
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    first = causal_varlen(
        q[parts.first], k[parts.first], v[parts.first], (parts.first_starts, parts.first_starts),
        (parts.first_longest, parts.first_longest), scaling,
    )  # fmt: skip
    rejected = causal_varlen(
        q[parts.rejected], k[parts.rejected_keys], v[parts.rejected_keys],
        (parts.rejected_starts, parts.rejected_key_starts), (parts.rejected_longest, parts.rejected_keys_longest),
        scaling,
    )  # fmt: skip
    # Padding stays 0: no scored token reads it.
    output = q.new_zeros(q.shape).index_copy(0, parts.first, first).index_copy(0, parts.rejected, rejected)
    return output.view(batch, length, heads, dim), None


SHARED_PROMPT_ATTENTION = "hellbender_shared_prompt_sdpa"


def register_shared_prompt_attention() -> str:
    """Register `shared_prompt_attention` as an attention implementation, with SDPA's mask builder, so a model loaded
    with SDPA keeps SDPA for every forward but the shared rows'. Returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_PROMPT_ATTENTION, shared_prompt_attention)
    AttentionMaskInterface.register(SHARED_PROMPT_ATTENTION, sdpa_mask)
    return SHARED_PROMPT_ATTENTION


class SharedPromptForward:
    """Put in front of a model's forward that TRL gave its fused LM head. A call with `fused_lm_head=True` and labels
    (TRL scoring a pair batch, policy or reference) runs the shared rows and returns TRL's output in its own layout;
    every other call passes through. `attend`: the forward keywords that say what each token sees (`attention_for`)."""

    def __init__(self, forward: Callable[..., Any], attend: Callable[[SharedPromptRows], dict[str, Any]]) -> None:
        self.forward = forward
        self.attend = attend

    def __call__(self, *args: Any, fused_lm_head: bool = False, labels: Any = None, **kwargs: Any) -> Any:
        if args or not fused_lm_head or labels is None or kwargs.get("input_ids") is None:
            return self.forward(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)
        input_ids, attention_mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask")
        rows = share_prompts(input_ids, labels, attention_mask)
        outputs = self.forward(
            input_ids=rows.input_ids,
            position_ids=rows.position_ids,
            labels=rows.labels,
            fused_lm_head=True,
            **self.attend(rows),
            **kwargs,
        )
        fields = {name: getattr(outputs, name) for name in outputs.__dataclass_fields__}
        for name in PER_TOKEN_FIELDS:
            if fields[name] is not None:
                fields[name] = rows.to_pair_rows(fields[name])
        fields["label_mask"] = rows.pair_scored
        return type(outputs)(**fields)


def attention_for(model: Any, attention: str) -> Callable[[SharedPromptRows], dict[str, Any]]:
    """How the shared rows' attention is set up for `attention`: the varlen kernel on CUDA in 16-bit precision (a
    model loaded with SDPA switches to `shared_prompt_attention`, which keeps SDPA for every other forward; the mask
    given beside it is all ones, which transformers turns into no mask); the dense mask elsewhere (additive for eager
    attention)."""
    parameter = next(model.parameters())
    if attention == "sdpa" and parameter.device.type == "cuda" and parameter.dtype in (torch.bfloat16, torch.float16):
        return varlen_attention(model)
    if attention == "eager":
        dtype = model.dtype
        return lambda rows: {"attention_mask": additive_mask(rows.segments, dtype)}
    return lambda rows: {"attention_mask": dense_mask(rows.segments)}


def varlen_attention(model: Any) -> Callable[[SharedPromptRows], dict[str, Any]]:
    """Switch `model` (loaded with SDPA) to `shared_prompt_attention` and return the forward keywords of shared rows:
    their `VarlenParts`, and a mask of ones, which transformers turns into no mask at all."""
    model.set_attn_implementation(register_shared_prompt_attention())
    return lambda rows: {"attention_mask": torch.ones_like(rows.input_ids), VARLEN_KEYWORD: VarlenParts.of(rows)}


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
    parameter = next(model.parameters())
    sixteen_bit = parameter.dtype in (torch.bfloat16, torch.float16)
    pays = shared_by_default(config._attn_implementation, parameter.device.type == "cuda", sixteen_bit)
    if reason is not None or not (required or pays):
        return False
    model.forward = SharedPromptForward(model.forward, attention_for(model, config._attn_implementation))
    return True
