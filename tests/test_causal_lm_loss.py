"""hellbender's causal-LM loss takes the logits as the model returns them, strided views included."""

from __future__ import annotations

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hellbender.train.trainer import causal_lm_loss


def test_strided_logits_give_the_loss_of_their_contiguous_copy():
    """ProphetNet returns the main stream of its [batch, ngram, seq, vocab] logits, a view `view` cannot flatten."""
    torch.manual_seed(0)
    streams = torch.randn(2, 2, 7, 11)
    logits = streams[:, 0]
    assert not logits.is_contiguous()
    labels = torch.randint(0, 11, (2, 7))
    expected = ForCausalLMLoss(logits.clone(), labels, 11)
    assert torch.equal(causal_lm_loss({"logits": logits}, labels), expected)
