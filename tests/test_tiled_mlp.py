"""Tiled MLP: the same losses and gradients as the untiled model, with fewer activations alive at once."""

from __future__ import annotations

import copy

import pytest
import torch

from hellbender.config import validate_config
from hellbender.models.activation_checkpointing import enable_activation_checkpointing
from hellbender.models.adapters import apply_adapter
from hellbender.models.loading import load_model, load_tokenizer_and_processor
from hellbender.models.tiled_mlp import ATTRIBUTE, DECODER_MLP, shard_count, tile_mlps
from hellbender.train.run import train
from tests.helpers import base_config, final_weights, logged_losses


def tiny_model(tmp_path, **overrides):
    cfg = validate_config(base_config(tmp_path, **overrides))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    torch.manual_seed(0)
    return cfg, apply_adapter(cfg, load_model(cfg, tokenizer))


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def shard_with_plain_autograd(model, shards: int) -> None:
    """The reference for dropout: the same shards in the same order (so the same random draws), kept in one graph
    by plain autograd instead of being recomputed in backward."""
    for name, module in model.named_modules():
        if DECODER_MLP.search(name):
            original = module.forward
            module.forward = lambda x, original=original: torch.cat(
                [original(part) for part in x.tensor_split(shards, dim=-2)], dim=-2
            )


@pytest.mark.parametrize(
    ("overrides", "checkpointing"),
    [
        ({}, False),  # full fine-tuning
        ({"adapter": "lora", "lora_target_linear": True, "lora_dropout": 0.0}, True),
        ({"adapter": "lora", "lora_target_linear": True, "lora_dropout": 0.3}, False),  # dropout replayed
    ],
)
def test_tiled_mlps_give_the_same_loss_and_gradients(tmp_path, overrides, checkpointing):
    cfg, plain = tiny_model(tmp_path, **overrides)
    if cfg.lora_dropout:  # dropout draws per shard: compare with the same shards kept in one graph
        shard_with_plain_autograd(plain, shards=5)
    tiled = copy.deepcopy(plain) if not cfg.lora_dropout else tiny_model(tmp_path, **overrides)[1]
    assert tile_mlps(tiled, shards=5) == plain.config.num_hidden_layers
    for model in (plain, tiled):
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model, offload=False)
    ids = torch.randint(3, 250, (2, 37), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    expected_loss, expected = loss_and_grads(plain, ids)
    torch.manual_seed(7)
    loss, got = loss_and_grads(tiled, ids)
    torch.testing.assert_close(loss, expected_loss)
    assert got.keys() == expected.keys() and any("mlp" in n for n in got)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_tiling_keeps_names_and_skips_evaluation(tmp_path):
    _, model = tiny_model(tmp_path)
    names = [n for n, _ in model.named_parameters()]
    tile_mlps(model)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and adapters see the same model
    mlps = [m for n, m in model.named_modules() if n.endswith("mlp")]
    assert mlps and all(hasattr(m, ATTRIBUTE) for m in mlps)
    assert tile_mlps(model) == 0  # never tiled twice
    with torch.no_grad():
        model.eval()
        ids = torch.tensor([[5, 6, 7]])
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_tiled_mlp_keeps_fewer_mlp_activations_for_backward(tmp_path):
    """What autograd keeps for backward, summed over every saved tensor: with the MLP tiled, its
    [tokens x intermediate] activations are recomputed in backward instead of kept."""
    _, plain = tiny_model(tmp_path, adapter="lora", lora_target_linear=True, lora_dropout=0.0)
    tiled = copy.deepcopy(plain)
    tile_mlps(tiled, shards=8)
    ids = torch.randint(3, 250, (1, 256), generator=torch.Generator().manual_seed(2))

    def saved_bytes(model) -> int:
        sizes: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids).loss.backward()
        return sum(sizes.values())

    plain_bytes, tiled_bytes = saved_bytes(plain), saved_bytes(tiled)
    intermediate = plain.config.intermediate_size * ids.numel() * 4  # one float32 MLP activation
    assert plain_bytes - tiled_bytes >= 2 * plain.config.num_hidden_layers * intermediate


def test_shard_count_defaults_to_one_shard_per_hidden_size_of_tokens():
    assert shard_count(tokens=10_000, hidden=4096, configured=None) == 3
    assert shard_count(tokens=100, hidden=4096, configured=None) == 1
    assert shard_count(tokens=100, hidden=4096, configured=8) == 8
    assert shard_count(tokens=4, hidden=4096, configured=8) == 4  # never an empty shard


def test_training_with_tiled_mlp_matches_training_without(tmp_path):
    common = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0, max_steps=3, gradient_checkpointing=True)
    plain = validate_config(base_config(tmp_path / "plain", **common))
    tiled = validate_config(base_config(tmp_path / "tiled", tiled_mlp=True, tiled_mlp_num_shards=3, **common))
    train(plain)
    train(tiled)
    assert logged_losses(tiled.output_dir) == pytest.approx(logged_losses(plain.output_dir), rel=1e-4)
    expected = final_weights(plain.output_dir)
    for name, tensor in final_weights(tiled.output_dir).items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-3, atol=1e-6)


def test_tiled_mlp_in_several_processes_is_refused_before_any_work(tmp_path, monkeypatch):
    from hellbender.errors import ConfigError

    cfg = validate_config(base_config(tmp_path, tiled_mlp=True))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for each process
    with pytest.raises(ConfigError, match="`tiled_mlp` runs in one training process only"):
        train(cfg)
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "out").exists()
