"""DPO pairs scored with their prompt once (`dpo_shared_prompt`): the shared rows hold exactly the tokens, positions
and labels they should, no answer sees the other, every per-token output and gradient equals TRL's two-row layout, a
DPO run trains the same losses either way, and a model that cannot share is refused by name or left on two rows."""

from __future__ import annotations

import pytest
import torch

from hellbender.train.shared_prompt import (
    CHOSEN,
    PADDING,
    PROMPT,
    REJECTED,
    SharedPromptForward,
    attention_for,
    dense_mask,
    share_prompts,
    use_shared_prompts,
)
from tests.test_packed_attention import tiny_config
from tests.test_preference_dpo import dpo_config, dpo_trainer, preference_pairs

IGNORE = -100


def pair_batch(pairs: list[tuple[list[int], list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """TRL's collated batch of (prompt, chosen, rejected) id lists, with the labels its DPO trainer derives."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rows = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs]
    batch = DataCollatorForPreference(pad_token_id=0)(rows)
    batch["labels"] = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    return batch


def random_pairs(lengths: list[tuple[int, int, int]], seed: int = 1) -> list[tuple[list[int], ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(5, 250, (n,), generator=gen).tolist() for n in pls) for pls in lengths]


def test_shared_rows_hold_the_prompt_once_and_each_answer_after_its_last_token():
    batch = pair_batch([([11, 12, 13], [21, 22], [31]), ([14, 15], [23], [32, 33, 34])])
    rows = share_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])
    assert rows.input_ids.tolist() == [[11, 12, 13, 21, 22, 13, 31], [14, 15, 23, 15, 32, 33, 34]]
    # The rejected answer's positions restart at the prompt's end, like its own row's in TRL's layout.
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 1, 2, 3, 4]]
    P, C, R, X = PROMPT, CHOSEN, REJECTED, PADDING
    assert rows.segments.tolist() == [[P, P, C, C, C, R, R], [P, C, C, R, R, R, R]]
    assert rows.labels.tolist() == [
        [IGNORE, IGNORE, IGNORE, 21, 22, IGNORE, 31],
        [IGNORE, IGNORE, 23, IGNORE, 32, 33, 34],
    ]
    # Padding after a shorter shared row is its own part.
    batch = pair_batch([([11, 12], [21], [31]), ([14, 15, 16], [23, 24], [32, 33])])
    rows = share_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])
    assert rows.segments.tolist() == [[P, C, C, R, R, X, X, X], [P, P, C, C, C, R, R, R]]
    assert rows.labels[0, 5:].tolist() == [IGNORE] * 3


def test_no_answer_sees_the_other_and_each_sees_the_whole_prompt():
    batch = pair_batch([([11, 12, 13], [21, 22], [31, 32])])
    rows = share_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])
    mask = dense_mask(rows.segments)[0, 0].int().tolist()
    # prompt[:-1] = 11 12 | 13 21 22 (chosen) | 13 31 32 (rejected)
    assert mask == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 1, 1, 1],
    ]


def fused_llama(attn: str = "sdpa", head_dim: int = 8):
    """The tiny Llama of tests/test_packed_attention.py with TRL's fused LM head."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.head_dim = head_dim
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_per_token_output_and_gradient_equals_the_two_row_layout(attn):
    """Pairs of unequal prompt and answer lengths (so every row of both layouts is padded somewhere). On a GPU the
    varlen kernels' attention is checked against this dense mask (tests/test_gpu_preference.py)."""
    assert_shared_equals_two_rows(fused_llama(attn=attn), attn, torch.device("cpu"))


def assert_shared_equals_two_rows(model, attn: str, device: torch.device, atol: float = 2e-6) -> None:
    model.to(device)
    batch = pair_batch(random_pairs([(5, 3, 7), (9, 4, 2), (1, 6, 6)]))
    inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}

    def run(forward):
        model.zero_grad()
        out = forward(**inputs, fused_lm_head=True, use_cache=False)
        out.log_probs.sum(dim=1).pow(2).sum().backward()  # per-pair sums, as DPO uses them, squared so rows differ
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return out, grads

    two_rows, two_row_grads = run(model.forward)
    shared, shared_grads = run(SharedPromptForward(model.forward, attention_for(model, attn)))
    for field in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(getattr(shared, field), getattr(two_rows, field), rtol=0, atol=atol)
    assert torch.equal(shared.is_top1, two_rows.is_top1) and torch.equal(shared.label_mask, two_rows.label_mask)
    assert shared.loss.item() == pytest.approx(two_rows.loss.item(), abs=atol)
    for name, grad in two_row_grads.items():  # float rounding of sums in another order: a millionth of the scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-5, atol=atol / 2 * scale, msg=name)
    assert any(g.abs().sum() > 0 for g in shared_grads.values())


def test_a_batch_that_is_not_pairs_of_one_prompt_is_refused():
    batch = pair_batch(random_pairs([(4, 2, 3), (3, 2, 2)]))
    batch["input_ids"][3, 1] += 1  # the second pair's rejected row no longer repeats its prompt
    with pytest.raises(ValueError, match="dpo_shared_prompt: false"):
        share_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])


def test_dpo_trains_the_same_losses_with_the_prompt_once_as_with_two_rows(tmp_path):
    rows = preference_pairs(32, seed=3)
    losses = {}
    for shared in (True, False):
        cfg = dpo_config(
            tmp_path / str(shared),
            max_steps=4,
            learning_rate=2e-2,
            gradient_checkpointing=True,  # the mask goes through hellbender's checkpointed layers
            dpo_shared_prompt=shared,
        )
        trainer = dpo_trainer(cfg, rows)
        forward = trainer.model.get_base_model().forward
        assert isinstance(forward, SharedPromptForward) is shared
        trainer.train()
        losses[shared] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses[True]) == 4 and losses[True][0] == pytest.approx(0.693147, abs=1e-6)
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
    assert losses[True][-1] < losses[True][0] - 0.01  # and it learns


def test_full_fine_tuning_scores_the_reference_copy_with_the_prompt_once_too(tmp_path):
    trainer = dpo_trainer(dpo_config(tmp_path, adapter=None, dpo_shared_prompt=True), preference_pairs(16, seed=0))
    assert isinstance(trainer.model.forward, SharedPromptForward)
    assert isinstance(trainer.ref_model.forward, SharedPromptForward)


@pytest.mark.parametrize(
    ("family", "attn", "needle"),
    [
        ("llama", "flash_attention_2", "flash_attention_2"),
        ("llama", "flex_attention", "flex_attention"),
        ("mistral", "sdpa", "sliding-window"),
        ("gemma3_text", "sdpa", "sliding_attention"),
    ],
)
def test_a_model_that_cannot_share_keeps_two_rows_or_is_refused_by_name(family, attn, needle):
    from transformers import AutoModelForCausalLM

    from hellbender.errors import ConfigError

    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    model.config._attn_implementation = attn  # what loading with that attention records; no kernel is needed here
    forward = model.forward
    assert use_shared_prompts(model, required=False) is False and model.forward == forward
    with pytest.raises(ConfigError, match=needle) as refused:
        use_shared_prompts(model, required=True)
    assert "`dpo_shared_prompt: true`" in str(refused.value) and "Remove `dpo_shared_prompt`" in str(refused.value)


def test_dpo_shared_prompt_is_a_dpo_key(tmp_path):
    """(Vision-language pairs refuse it too: tests/test_preference_vlm.py.)"""
    from hellbender.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dpo_shared_prompt.*rl: kto"):
        dpo_config(tmp_path, rl="kto", dpo_shared_prompt=True)


def reference_varlen(query, key, value, starts, longest, scale):
    """What torch's flash-attention varlen kernel computes (causal, aligned at each sequence's end), sequence by
    sequence with a dense mask: stands in for the CUDA-only kernel so the parts' bookkeeping is checked on CPU."""
    outputs = []
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    q_starts, k_starts = starts[0].tolist(), starts[1].tolist()
    for i in range(len(q_starts) - 1):
        (q0, q1), (k0, k1) = q_starts[i : i + 2], k_starts[i : i + 2]
        q, k, v = (t.transpose(0, 1) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        seen = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(diagonal=(k1 - k0) - (q1 - q0))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def test_the_varlen_parts_give_each_token_what_the_dense_mask_gives_it(monkeypatch):
    """The GPU path's bookkeeping (which flat tokens each kernel call gets, how its outputs go back) on CPU, with the
    kernel replaced by its dense equivalent; the kernel itself is checked on a GPU (tests/test_gpu_preference.py)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import hellbender.train.shared_prompt as shared_prompt

    monkeypatch.setattr(shared_prompt, "causal_varlen", reference_varlen)
    batch = pair_batch(random_pairs([(7, 3, 9), (13, 4, 2), (1, 6, 6)]))
    rows = share_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, rows.input_ids.shape[1], 8, generator=gen) for h in (4, 2, 2))
    module = type("Attention", (), {"num_key_value_groups": 2, "training": False, "is_causal": True})()
    parts = {shared_prompt.VARLEN_KEYWORD: shared_prompt.VarlenParts.of(rows)}
    got, _ = shared_prompt.shared_prompt_attention(module, q, k, v, None, scaling=0.3, **parts)
    expected, _ = sdpa_attention_forward(module, q, k, v, dense_mask(rows.segments), scaling=0.3)
    real = (rows.segments != PADDING)[..., None, None]
    torch.testing.assert_close(got * real, expected * real, rtol=0, atol=1e-6)
    assert (got[~real.expand_as(got)] == 0).all()  # padding is left at 0


def test_the_varlen_parts_reach_every_layers_attention_through_the_models_forward(monkeypatch):
    """transformers hands the forward's `VarlenParts` keyword down to each layer's attention call: the model switched
    to the varlen attention scores every token as TRL's two rows do (the kernel replaced by its dense equivalent)."""
    import hellbender.train.shared_prompt as shared_prompt

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return reference_varlen(*args, **kwargs)

    monkeypatch.setattr(shared_prompt, "causal_varlen", counted)
    model = fused_llama()
    batch = pair_batch(random_pairs([(5, 3, 7), (9, 4, 2), (1, 6, 6)]))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        two_rows = model(**inputs, fused_lm_head=True, use_cache=False)
        shared = SharedPromptForward(model.forward, shared_prompt.varlen_attention(model))
        got = shared(**inputs, fused_lm_head=True, use_cache=False)
        plain = model(**inputs, fused_lm_head=True, use_cache=False)  # every other forward keeps SDPA
    assert model.config._attn_implementation == shared_prompt.SHARED_PROMPT_ATTENTION
    assert len(calls) == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(got.log_probs, two_rows.log_probs, rtol=0, atol=2e-6)
    torch.testing.assert_close(plain.log_probs, two_rows.log_probs, rtol=0, atol=0)
