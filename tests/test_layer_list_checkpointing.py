"""Families whose transformers classes offer no activation checkpointing (CTRL, GPT-1, GPT-NeoX Japanese, XLNet,
XLM) get hellbender's own, over their per-layer module lists; JetMoE's layers are transformers' checkpointing layers,
though its class says it does not support checkpointing. In each, checkpointing must recompute (fewer tensors kept
from the forward) and give the same gradients; Reformer, whose reversible layers recompute already, is refused. A
causal XLNet, which these runs train, also needs its padding mask dropped for batches of several rows."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hellbender.errors import ConfigError
from hellbender.models.activation_checkpointing import enable_activation_checkpointing, layers_left_unchecked
from hellbender.models.fixes.encoders import make_causal
from hellbender.models.layer_list_checkpointing import per_layer_modules
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import model_survey

survey = model_survey()
FAMILIES = ("ctrl", "openai-gpt", "gpt_neox_japanese", "xlnet", "xlm", "jetmoe")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def tiny(model_type: str, tokenizer) -> torch.nn.Module:
    config = survey.tiny_config(model_type, tokenizer)
    make_causal(config, {})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().train()


def gradients_and_kept_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """Each parameter's gradient of one seeded training step (dropout included), and how many tensors the forward
    kept for backward outside checkpointed calls."""
    kept = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += 1
        return tensor

    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    torch.manual_seed(2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, kept


@pytest.mark.parametrize("model_type", FAMILIES)
def test_checkpointing_recomputes_and_keeps_the_gradients(model_type, tokenizer):
    plain, kept_plain = gradients_and_kept_tensors(tiny(model_type, tokenizer))
    model = tiny(model_type, tokenizer)
    enable_activation_checkpointing(model)
    checkpointed, kept_checkpointed = gradients_and_kept_tensors(model)
    assert kept_checkpointed < 0.6 * kept_plain, (kept_checkpointed, kept_plain)  # XLM keeps its norm lists
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_per_layer_modules_are_the_outermost_lists_and_leave_norms_out(tokenizer):
    model = tiny("xlm", tokenizer)
    layers = per_layer_modules(model)
    assert len(layers) == model.config.num_hidden_layers
    assert [[type(m).__name__ for m in modules] for modules in layers][0] == ["MultiHeadAttention", "TransformerFFN"]


def test_only_the_first_layers_are_checkpointed_when_asked(tokenizer):
    model = tiny("ctrl", tokenizer)
    assert len(layers_left_unchecked(model, 1)) == model.config.num_hidden_layers - 1
    enable_activation_checkpointing(model, layers=1)
    first, *rest = per_layer_modules(model)
    assert all("forward" in vars(module) for module in first)
    assert all("forward" not in vars(module) for modules in rest for module in modules)


def test_offloading_layers_hellbender_checkpoints_itself_is_refused_by_name(tokenizer):
    """`activation_offload_layers` hands transformers' checkpointing layers another call; these families have none."""
    with pytest.raises(ConfigError, match="`activation_offload_layers` is set, but CTRLLMHeadModel's layers"):
        enable_activation_checkpointing(tiny("ctrl", tokenizer), offload_layers=1)


def test_checkpointing_is_off_outside_training(tokenizer):
    model = tiny("openai-gpt", tokenizer)
    enable_activation_checkpointing(model)
    model.eval()
    _, kept_eval = gradients_and_kept_tensors(model)
    model.train()
    _, kept_train = gradients_and_kept_tensors(model)
    assert kept_eval > kept_train


def test_reversible_reformer_layers_refuse_checkpointing_with_the_reason(tokenizer):
    model = AutoModelForCausalLM.from_config(survey.tiny_config("reformer", tokenizer))
    with pytest.raises(ConfigError, match="reversible.*`gradient_checkpointing: false`"):
        enable_activation_checkpointing(model)


def test_a_causal_xlnet_trains_on_a_right_padded_batch_as_on_each_row_alone(tokenizer):
    from hellbender.models.fixes.xlnet import drop_trailing_padding_mask

    model = tiny("xlnet", tokenizer).eval()
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with pytest.raises(RuntimeError, match="broadcast"):  # transformers' own failure, which the fix is for
        model(input_ids=ids, attention_mask=mask)
    drop_trailing_padding_mask(model)
    batched = model(input_ids=ids, attention_mask=mask).logits
    alone = model(input_ids=ids[1:, :6], attention_mask=mask[1:, :6]).logits
    torch.testing.assert_close(batched[1:, :6], alone, rtol=1e-10, atol=1e-12)
    left = mask.flip(1)  # padding first: the mask is needed, so it stays (and transformers fails as before)
    with pytest.raises(RuntimeError, match="broadcast"):
        model(input_ids=ids, attention_mask=left)
