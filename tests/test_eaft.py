"""Entropy-aware focal training (`use_eaft`): the loss is the entropy-weighted cross-entropy written out by hand,
alpha 0 is plain cross-entropy, the weights carry no gradient, accumulation stays exact, and it is refused where the
logits do not exist."""

from __future__ import annotations

import math

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.train.eaft import eaft_loss
from hellbender.train.run import train
from hellbender.train.trainer import causal_lm_loss
from tests.helpers import base_config, final_weights, logged_losses, trainer_state, vlm_config
from tests.tiny_vlms import QWEN

VOCAB = 50


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 7 positions; prompt and padding positions are -100, as the collators write them."""
    logits = torch.randn(2, 7, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    labels = torch.tensor([[-100, -100, 4, 9, 17, 2, -100], [-100, 31, 8, 8, 40, -100, -100]])
    return logits, labels


def reference(logits: torch.Tensor, labels: torch.Tensor, alpha: float, k: int) -> torch.Tensor:
    """Weighted token losses summed, position by position: position t predicts label t + 1; the weight is the entropy of
    the softmax over the k largest logits at t, to the power alpha."""
    total = torch.zeros(())
    for row in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[row, t + 1])
            if target == -100:
                continue
            scores = logits[row, t]
            nll = torch.logsumexp(scores, 0) - scores[target]
            top = sorted(scores.tolist(), reverse=True)[:k]
            z = sum(math.exp(s) for s in top)
            entropy = -sum(math.exp(s) / z * math.log(math.exp(s) / z) for s in top)
            total = total + nll * entropy**alpha
    return total


@pytest.mark.parametrize(("alpha", "k"), [(1.0, 20), (0.5, 5), (2.0, 3), (1.0, VOCAB + 10)])
def test_the_loss_is_the_entropy_weighted_cross_entropy(alpha, k):
    logits, labels = batch()
    trained = 8  # labels[..., 1:] that are not -100
    expected = reference(logits, labels, alpha, k)
    accumulated = eaft_loss({"logits": logits}, labels, num_items_in_batch=torch.tensor(20), alpha=alpha, k=k)
    torch.testing.assert_close(accumulated, expected / 20)
    alone = eaft_loss({"logits": logits}, labels, alpha=alpha, k=k)  # evaluation: this batch's trained tokens
    torch.testing.assert_close(alone, expected / trained)


def test_alpha_zero_is_plain_cross_entropy():
    logits, labels = batch()
    for items in (None, torch.tensor(11)):
        plain = causal_lm_loss({"logits": logits}, labels, num_items_in_batch=items)
        torch.testing.assert_close(eaft_loss({"logits": logits}, labels, items, alpha=0.0, k=20), plain)
    # and alpha 1 is not: the weights matter
    assert not torch.allclose(
        eaft_loss({"logits": logits}, labels, alpha=1.0, k=20), causal_lm_loss({"logits": logits}, labels)
    )


def test_the_weights_carry_no_gradient():
    """The gradient is that of the cross-entropy with the weights held constant."""
    logits, labels = batch()
    logits.requires_grad_(True)
    eaft_loss({"logits": logits}, labels, alpha=1.0, k=20).backward()
    got = logits.grad.clone()
    logits.grad = None
    constant = logits.detach()
    weights = torch.zeros(2, 7)
    for row in range(2):
        for t in range(7):
            p = torch.softmax(torch.topk(constant[row, t], 20).values, 0)
            weights[row, t] = -(p * p.log()).sum()
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="none"
    )
    ((nll * weights.reshape(-1)).sum() / 8).backward()
    torch.testing.assert_close(got, logits.grad)


def test_bf16_logits_give_the_float32_loss_of_the_same_values():
    logits, labels = batch()
    low = logits.bfloat16()
    torch.testing.assert_close(
        eaft_loss({"logits": low}, labels, alpha=1.0, k=20), eaft_loss({"logits": low.float()}, labels, alpha=1.0, k=20)
    )


# --- through the Trainer ---------------------------------------------------------------------------------------

# Plain SGD: the final weights differ exactly as the gradients do (Adam's first steps are about sign(gradient)).
EXACT = dict(
    adapter="lora", lora_target_linear=True, max_steps=1, optimizer="sgd", learning_rate=0.5, sample_packing=True
)


def test_gradient_accumulation_stays_exact_and_eaft_changes_the_step(tmp_path):
    """One step of micro-batch 4 == one step of 2 accumulated micro-batches of 2 (the weighted losses are summed and
    divided by the trained tokens of all 4 rows), and differs from the same step with plain cross-entropy."""
    eaft = dict(EXACT, use_eaft=True, eaft_alpha=1.0, eaft_k=20)
    big = validate_config(base_config(tmp_path / "big", micro_batch_size=4, **eaft))
    small = validate_config(base_config(tmp_path / "acc", micro_batch_size=2, gradient_accumulation_steps=2, **eaft))
    plain = validate_config(base_config(tmp_path / "plain", micro_batch_size=4, **EXACT))
    for cfg in (big, small, plain):
        train(cfg)
    a, b, c = (final_weights(cfg.output_dir) for cfg in (big, small, plain))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    assert logged_losses(big.output_dir)[1] == pytest.approx(logged_losses(small.output_dir)[1], rel=1e-5)
    assert any(not torch.allclose(a[key], c[key], atol=1e-6) for key in a)
    assert logged_losses(big.output_dir)[1] != pytest.approx(logged_losses(plain.output_dir)[1], rel=1e-3)


def test_alpha_zero_trains_as_plain_cross_entropy(tmp_path):
    zero = validate_config(base_config(tmp_path / "zero", micro_batch_size=4, use_eaft=True, eaft_alpha=0, **EXACT))
    plain = validate_config(base_config(tmp_path / "plain", micro_batch_size=4, **EXACT))
    train(zero)
    train(plain)
    a, b = final_weights(zero.output_dir), final_weights(plain.output_dir)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)


def test_a_short_run_with_eaft_learns_and_evaluates(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            use_eaft=True,
            adapter="lora",
            lora_target_linear=True,
            lora_r=16,
            max_steps=30,
            sample_packing=True,
            lora_modules_to_save=["embed_tokens", "lm_head"],
            val_set_size=0.1,
            eval_steps=30,
        )
    )
    metrics = train(cfg)
    losses = list(logged_losses(cfg.output_dir).values())
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3, losses
    assert metrics["trained_tokens"] > 0
    evaluated = [e["eval_loss"] for e in trainer_state(cfg.output_dir)["log_history"] if "eval_loss" in e]
    assert evaluated and all(math.isfinite(loss) for loss in evaluated)


def test_a_vision_language_model_trains_with_eaft(tmp_path):
    """Image+text batches take the same loss path: the weighted loss of the first step differs from the plain one."""
    common = dict(adapter="lora", max_steps=1, micro_batch_size=2)
    eaft = validate_config(vlm_config(tmp_path / "eaft", QWEN, use_eaft=True, **common))
    plain = validate_config(vlm_config(tmp_path / "plain", QWEN, **common))
    train(eaft)
    train(plain)
    weighted, unweighted = logged_losses(eaft.output_dir)[1], logged_losses(plain.output_dir)[1]
    assert math.isfinite(weighted) and weighted != pytest.approx(unweighted, rel=1e-3)


# --- refusals ---------------------------------------------------------------------------------------------------

CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"liger_fused_linear_cross_entropy": True}, "`liger_fused_linear_cross_entropy`"),
        ({"cut_cross_entropy": True}, "`cut_cross_entropy`"),
        ({"plugins": [CCE_PLUGIN]}, CCE_PLUGIN),
    ],
)
def test_eaft_is_refused_where_the_logits_never_exist(tmp_path, keys, named):
    with pytest.raises(ConfigError, match=r"`use_eaft: true` weights each token's loss") as error:
        validate_config(base_config(tmp_path, use_eaft=True, **keys))
    assert named in str(error.value)


def test_the_plugin_with_its_fused_loss_turned_off_is_accepted(tmp_path):
    cfg = validate_config(base_config(tmp_path, use_eaft=True, plugins=[CCE_PLUGIN], cut_cross_entropy=False))
    assert cfg.use_eaft and not cfg.fuses_the_loss


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"eaft_alpha": 0.5}, r"`eaft_alpha` tunes entropy-aware focal training, and `use_eaft` is off"),
        ({"eaft_alpha": 2, "eaft_k": 5}, r"`eaft_alpha` and `eaft_k` tune entropy-aware focal training"),
        ({"use_eaft": True, "eaft_k": 1}, r"`eaft_k`"),
        ({"use_eaft": True, "eaft_alpha": -1}, r"`eaft_alpha`"),
    ],
)
def test_eaft_settings_that_would_do_nothing_or_cannot_work_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_the_resolved_config_shows_the_eaft_settings(tmp_path):
    cfg = validate_config(base_config(tmp_path, use_eaft=True))
    assert (cfg.use_eaft, cfg.eaft_alpha, cfg.eaft_k) == (True, 1.0, 20)
    off = validate_config(base_config(tmp_path, eaft_alpha=1.0, eaft_k=20))  # a dumped config of a plain run reloads
    assert not off.use_eaft
