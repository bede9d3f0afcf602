"""Activation checkpointing: nothing of one step outlives it, the side channel works from any thread and for two
models at once, gradients are exact, and Gemma 4's wide heads get an SDPA without the math fallback."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, TrainerCallback

from hellbender.config import validate_config
from hellbender.errors import EnvironmentProblem
from hellbender.models.activation_checkpointing import (
    MUTABLE_CONTAINERS,
    enable_activation_checkpointing,
    side_channel_of,
)
from hellbender.models.tiny import tiny_model_dir
from hellbender.train.run import train
from tests.helpers import base_config, vlm_config
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN

GEMMA4_TEXT = "hellbender/tiny-gemma4"
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def gemma4_variant(target: Path, **changes: Any) -> Path:
    """The tiny text Gemma 4 with some settings changed (Gemma 4's real head_dim 512, an MoE block), saved."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from hellbender.models.tiny_vlm.gemma4 import build_config, build_tokenizer

    if not (target / "config.json").is_file():
        tokenizer = build_tokenizer()
        settings = build_config(tokenizer).text_config.to_dict()
        del settings["per_layer_config"]  # derived from the other settings at construction
        torch.manual_seed(0)
        Gemma4ForCausalLM(Gemma4TextConfig(**{**settings, **changes})).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def moe_gemma4(tmp_path_factory) -> Path:
    return gemma4_variant(tmp_path_factory.mktemp("gemma4-moe"), **MOE)


# --- nothing from step k survives step k --------------------------------------------------------------------------


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # ModelOutput is a dict too
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class StepLeakCheck(TrainerCallback):
    """With the garbage collector off, holds weak references to every tensor a module returns during a step and
    to every mutable container passed to a module, and records which are still alive when the step has ended and
    when the next step has ended. A tensor the model keeps as its own attribute until its next forward (Qwen2.5-VL's
    `rope_deltas`) is reported apart, as model state."""

    def __init__(self) -> None:
        self.refs: list[tuple[str, weakref.ref]] = []
        self.previous: list[tuple[str, weakref.ref]] = []
        self.survivors: list[list[str]] = []  # alive at the end of their own step
        self.model_state: list[list[str]] = []  # of those, held as a module attribute
        self.survivors_next: list[list[str]] = []  # alive at the end of the following step
        self.seen: list[tuple[int, int]] = []  # (tensors, containers) watched per step
        self.channel_sizes: list[int] = []
        self.handles: list[Any] = []
        self.collecting = False
        self.model: Any = None

    def _watch(self, what: str, value: Any) -> None:
        try:
            self.refs.append((what, weakref.ref(value)))
        except TypeError:  # a plain dict cannot be weakly referenced; its tensors can
            for tensor in _tensors(value):
                self.refs.append((f"{what} item", weakref.ref(tensor)))

    def _pre_hook(self, module, args, kwargs) -> None:
        if self.collecting:
            for name, value in kwargs.items():
                if isinstance(value, MUTABLE_CONTAINERS) and not isinstance(value, torch.nn.Module):
                    self._watch(f"{type(module).__name__}({name}=)", value)

    def _hook(self, module, args, output) -> None:
        if self.collecting:
            for tensor in _tensors(output):
                self.refs.append((f"{type(module).__name__} output", weakref.ref(tensor)))

    def _held_by_a_module(self, value: Any) -> bool:
        return any(any(v is value for v in vars(m).values()) for m in self.model.modules())

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._hook))
        gc.disable()

    def on_step_begin(self, args, state, control, **kwargs):
        self.refs = []
        self.collecting = True

    def on_step_end(self, args, state, control, **kwargs):
        self.collecting = False
        containers = sum(1 for what, _ in self.refs if "=)" in what)
        self.seen.append((len(self.refs) - containers, containers))
        alive = [(what, ref()) for what, ref in self.refs if ref() is not None]
        state_held = [what for what, value in alive if self._held_by_a_module(value)]
        self.model_state.append(sorted(set(state_held)))
        self.survivors.append(sorted({what for what, _ in alive} - set(state_held)))
        del alive
        if self.previous:
            self.survivors_next.append(sorted({what for what, ref in self.previous if ref() is not None}))
        channel = side_channel_of(self.model)
        self.channel_sizes.append(len(channel) if channel is not None else 0)
        self.previous, self.refs = self.refs, []

    def on_train_end(self, args, state, control, **kwargs):
        gc.enable()
        for handle in self.handles:
            handle.remove()


FAMILIES = {
    "llama": dict(base_model="hellbender/tiny-llama"),
    "gemma4-text": dict(base_model=GEMMA4_TEXT),
    "gemma4-moe": dict(base_model="moe"),
    "gemma4-vlm": dict(vlm=GEMMA4),
    "qwen2.5-vl": dict(vlm=QWEN),
    "llava": dict(vlm=LLAVA),
    "idefics3": dict(vlm=IDEFICS3),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_nothing_created_in_a_steps_forward_survives_it(tmp_path, family, checkpointing, request):
    common = dict(max_steps=3, adapter="lora", gradient_checkpointing=checkpointing, memory_watchdog="off")
    spec = FAMILIES[family]
    if "vlm" in spec:
        cfg = vlm_config(tmp_path, spec["vlm"], micro_batch_size=2, **common)
    else:
        base_model = str(request.getfixturevalue("moe_gemma4")) if spec["base_model"] == "moe" else spec["base_model"]
        cfg = base_config(tmp_path, base_model=base_model, micro_batch_size=2, **common)
    check = StepLeakCheck()
    try:
        train(validate_config(cfg), callbacks=[check])
    finally:
        gc.enable()
    assert len(check.survivors) == 3
    assert all(tensors > 50 for tensors, _ in check.seen), check.seen  # the hooks did watch the forward
    if family.startswith("gemma4"):
        # The shared K/V dict reached every decoder layer (and is what this test is mostly about).
        assert all(containers >= 5 for _, containers in check.seen), check.seen
    assert check.survivors == [[], [], []], check.survivors
    assert check.survivors_next == [[], []], check.survivors_next
    if family.startswith("gemma4"):
        assert check.model_state == [[], [], []], check.model_state
    assert check.channel_sizes == [0, 0, 0]


# --- Gemma 4 at model level ---------------------------------------------------------------------------------------


def gemma4(name: str | Path = GEMMA4_TEXT, seed: int | None = None) -> torch.nn.Module:
    cls = AutoModelForImageTextToText if name == GEMMA4 else AutoModelForCausalLM
    model = cls.from_pretrained(name if isinstance(name, Path) else tiny_model_dir(name), dtype=torch.float32)
    if seed is not None:  # a different model of the same shape
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.train()
    return model


def token_batch(seed: int = 0) -> torch.Tensor:
    # Longer than the tiny model's sliding window (16), so the shared K/V crosses sliding and full layers.
    return torch.randint(10, 200, (2, 40), generator=torch.Generator().manual_seed(seed))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.get_decoder().layers


def shared_kv_refs(model: torch.nn.Module) -> list[weakref.ref]:
    """Weak references, filled during each forward, to the shared K/V dict and its tensors as the last layer sees
    them (all K/V stored by then)."""
    refs: list[weakref.ref] = []

    def grab(module, args, kwargs):
        shared = kwargs["shared_kv_states"]
        refs.append(weakref.ref(shared))
        refs.extend(weakref.ref(t) for pair in shared.values() for t in pair)

    decoder_layers(model)[-1].register_forward_pre_hook(grab, with_kwargs=True)
    return refs


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", [GEMMA4_TEXT, GEMMA4])
def test_a_forward_without_backward_leaves_its_shared_kv_to_the_next_forward_only(name):
    """A forward whose backward never runs (a step skipped after an error, a probe in training mode) leaves the
    checkpoint replay functions alive in a reference cycle with the K/V tensors. Captured in the replay function
    (transformers' default), the shared K/V dict stays in that cycle until the garbage collector runs; routed
    through the side channel it is released when the model's next forward starts."""
    survived = {}
    for side_channel in (True, False):
        model = gemma4(name)
        enable_activation_checkpointing(model, side_channel=side_channel)
        refs = shared_kv_refs(model)
        gc.disable()
        try:
            model(input_ids=token_batch(), labels=token_batch()).loss  # noqa: B018 - the forward is the point
            first_step = list(refs)
            assert len(first_step) == 5  # the dict, and K and V of one sliding and one full layer
            model(input_ids=token_batch(1), labels=token_batch(1)).loss  # noqa: B018
            survived[side_channel] = sum(ref() is not None for ref in first_step)
        finally:
            gc.enable()
    assert survived == {True: 0, False: 5}


def test_backward_replayed_on_another_thread_reads_the_side_channel():
    """Autograd may replay a checkpointed layer on one of its worker threads; the side channel is an attribute of
    the model, so that thread sees it (thread-local storage would not)."""
    plain = gemma4()
    plain(input_ids=token_batch(), labels=token_batch()).loss.backward()

    model = gemma4()
    enable_activation_checkpointing(model)
    threads: list[int] = []
    reader = decoder_layers(model)[-1].self_attn  # reads the shared K/V
    reader.register_forward_pre_hook(lambda *_: threads.append(threading.get_ident()))
    loss = model(input_ids=token_batch(), labels=token_batch()).loss
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert threads[0] == threading.get_ident() and threads[1] == worker.ident  # forward here, replay there
    assert grads(model).keys() == grads(plain).keys()
    for name, grad in grads(plain).items():
        torch.testing.assert_close(grads(model)[name], grad, atol=1e-7, rtol=1e-6, msg=name)


def test_two_gemma4_models_with_interleaved_forwards_match_each_run_alone():
    """Policy and reference, student and teacher: two models alive at once, forwards interleaved before either
    backward. Each model's replay reads its own shared K/V (a process-wide store would hand one model the
    other's)."""

    def alone(seed: int | None) -> tuple[float, dict[str, torch.Tensor]]:
        model = gemma4(seed=seed)
        enable_activation_checkpointing(model)
        loss = model(input_ids=token_batch(seed or 0), labels=token_batch(seed or 0)).loss
        loss.backward()
        return loss.item(), grads(model)

    expected = {seed: alone(seed) for seed in (None, 7)}
    first, second = gemma4(), gemma4(seed=7)
    for model in (first, second):
        enable_activation_checkpointing(model)
    loss_first = first(input_ids=token_batch(0), labels=token_batch(0)).loss
    loss_second = second(input_ids=token_batch(7), labels=token_batch(7)).loss
    loss_first.backward()
    loss_second.backward()
    for seed, model, loss in ((None, first, loss_first), (7, second, loss_second)):
        expected_loss, expected_grads = expected[seed]
        assert loss.item() == expected_loss
        assert expected_loss != expected[7 if seed is None else None][0]  # the two models do differ
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads(model)[name], grad, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("offload", [False, True], ids=["in-place", "offloaded"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gradients_are_exact_with_the_side_channel_on_and_off(offload, moe, request):
    source = request.getfixturevalue("moe_gemma4") if moe else GEMMA4_TEXT
    plain = gemma4(source)
    if moe:
        assert plain.config.enable_moe_block and plain.config.num_kv_shared_layers == 2
    plain(input_ids=token_batch(), labels=token_batch()).loss.backward()
    for side_channel in (True, False):
        model = gemma4(source)
        enable_activation_checkpointing(model, offload=offload, side_channel=side_channel)
        model(input_ids=token_batch(), labels=token_batch()).loss.backward()
        for name, grad in grads(plain).items():
            torch.testing.assert_close(grads(model)[name], grad, atol=1e-7, rtol=1e-6, msg=f"{side_channel} {name}")


def test_a_replay_after_the_models_next_forward_fails_loudly():
    model = gemma4()
    enable_activation_checkpointing(model)
    loss = model(input_ids=token_batch(), labels=token_batch()).loss
    model(input_ids=token_batch(1), labels=token_batch(1))  # a second forward before the first backward
    with pytest.raises(RuntimeError, match="started another forward"):
        loss.backward()


def test_checkpointing_is_inactive_outside_training():
    model = gemma4()
    channel = enable_activation_checkpointing(model)
    model.eval()
    model(input_ids=token_batch())
    with torch.no_grad():
        model.train()
        model(input_ids=token_batch())
    model.train()
    deposits = []
    original = channel.deposit
    channel.deposit = lambda arguments: deposits.append(arguments) or original(arguments)
    model(input_ids=token_batch())
    assert len(deposits) == len(decoder_layers(model))  # only now, in training with gradients


# --- shared K/V key convention ------------------------------------------------------------------------------------


def test_the_shared_kv_key_follows_the_installed_transformers_convention():
    from hellbender.models.fixes.gemma4 import shared_kv_key, text_attention_modules

    keys = [shared_kv_key(attention) for attention in text_attention_modules(gemma4())]
    # Layers 1 and 2 store K/V, 3 and 4 reuse them (see tiny_vlm/gemma4.py); this transformers keys by layer type.
    assert keys == [None, "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    older = SimpleNamespace(kv_shared_layer_index=2, layer_idx=4, store_full_length_kv=False)
    storing = SimpleNamespace(kv_shared_layer_index=None, layer_idx=2, store_full_length_kv=True)
    assert (shared_kv_key(older), shared_kv_key(storing)) == (2, 2)  # up to transformers 5.5: the storing index
    with pytest.raises(EnvironmentProblem, match="neither `kv_shared_layer_index` nor"):
        shared_kv_key(SimpleNamespace(layer_idx=0))


# --- attention heads wider than 256 ---------------------------------------------------------------------------------


def reference_attention(query, key, value, mask: torch.Tensor | None) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2)
    if mask is None:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("head_dim", [64, 512])
def test_large_head_sdpa_computes_grouped_query_attention(head_dim, masked):
    from hellbender.models.attention import large_head_sdpa

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 12, head_dim, generator=generator)
    key, value = (torch.randn(2, 2, 12, head_dim, generator=generator) for _ in range(2))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    mask[:, :3] = False
    mask[torch.arange(12), torch.arange(12)] = True
    module = SimpleNamespace(num_key_value_groups=4, is_causal=True, training=True)
    output, _ = large_head_sdpa(module, query, key, value, mask[None, None] if masked else None, scaling=1.0)
    expected = reference_attention(query, key, value, mask if masked else None)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_gemma4_full_attention_wider_than_256_trains_with_the_large_head_sdpa(tmp_path):
    from hellbender.models.attention import LARGE_HEAD_SDPA
    from hellbender.models.fixes import prepare_for_training

    path = gemma4_variant(tmp_path / "wide", global_head_dim=512)
    narrow = prepare_for_training(gemma4(), "sdpa")
    assert narrow.config._attn_implementation == "sdpa"  # head_dim 32: nothing to change
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    wide = prepare_for_training(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "sdpa")
    assert wide.config._attn_implementation == LARGE_HEAD_SDPA
    for model in (stock, wide):
        model.train()
        model(input_ids=token_batch(), labels=token_batch()).loss.backward()
    for name, grad in grads(stock).items():
        torch.testing.assert_close(grads(wide)[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # And through `hellbender train`, checkpointed.
    cfg = base_config(tmp_path, base_model=str(path), max_steps=2, gradient_checkpointing=True, adapter="lora")
    metrics = train(validate_config(cfg))
    assert metrics["train_loss"] > 0


def test_gradient_checkpointing_accepts_offload_and_refuses_other_words(tmp_path):
    from hellbender.errors import ConfigError

    assert validate_config(base_config(tmp_path, gradient_checkpointing="offload")).gradient_checkpointing == "offload"
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        validate_config(base_config(tmp_path, gradient_checkpointing="sometimes"))


# --- checkpointing only some layers -------------------------------------------------------------------------------


def test_only_the_first_layers_are_recomputed_and_gradients_stay_exact():
    """`gradient_checkpointing_layers: 3` on the 5-layer Gemma 4, whose last layers read K/V an earlier layer
    stored: layers 0-2 run their MLP again in backward, layers 3-4 do not, and the gradients equal the unchecked
    model's."""
    plain = gemma4()
    plain(input_ids=token_batch(), labels=token_batch()).loss.backward()
    model = gemma4()
    assert model.config.num_kv_shared_layers > 0
    enable_activation_checkpointing(model, layers=3)
    calls = [0] * len(decoder_layers(model))
    for index, layer in enumerate(decoder_layers(model)):
        layer.mlp.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    model(input_ids=token_batch(), labels=token_batch()).loss.backward()
    assert calls == [2, 2, 2, 1, 1]
    for name, grad in grads(plain).items():
        torch.testing.assert_close(grads(model)[name], grad, atol=1e-7, rtol=1e-6, msg=name)


def test_checkpointing_more_layers_than_the_model_has_is_refused_by_name():
    from hellbender.errors import ConfigError

    with pytest.raises(ConfigError, match=r"`gradient_checkpointing_layers: 9`, but .* has 5 decoder layers"):
        enable_activation_checkpointing(gemma4(), layers=9)


def test_too_many_checkpointed_layers_are_refused_before_the_data_is_prepared(tmp_path):
    from hellbender.errors import ConfigError

    cfg = validate_config(base_config(tmp_path, gradient_checkpointing=True, gradient_checkpointing_layers=3))
    with pytest.raises(ConfigError, match=r"`gradient_checkpointing_layers: 3`, but .* has 2 decoder layers"):
        train(cfg)
    assert not Path(cfg.dataset_prepared_path).exists() or not any(Path(cfg.dataset_prepared_path).iterdir())


def test_gradient_checkpointing_layers_needs_checkpointing(tmp_path):
    from hellbender.errors import ConfigError

    cfg = validate_config(base_config(tmp_path, gradient_checkpointing=True, gradient_checkpointing_layers=1))
    assert cfg.gradient_checkpointing_layers == 1
    with pytest.raises(ConfigError, match="`gradient_checkpointing_layers` is set but activation checkpointing"):
        validate_config(base_config(tmp_path, gradient_checkpointing_layers=1))


def test_offloading_more_layers_than_are_checkpointed_is_refused_before_the_data_is_prepared(tmp_path):
    from hellbender.errors import ConfigError

    cfg = validate_config(
        base_config(tmp_path, gradient_checkpointing=True, gradient_checkpointing_layers=1, activation_offload_layers=2)
    )
    with pytest.raises(ConfigError, match=r"`activation_offload_layers: 2` .* checkpoints 1 "):
        train(cfg)
    assert not Path(cfg.dataset_prepared_path).exists() or not any(Path(cfg.dataset_prepared_path).iterdir())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "activation checkpointing is off"),
        (
            {"gradient_checkpointing": True, "fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}},
            "with FSDP2 or DeepSpeed is not supported",
        ),
        (
            {"gradient_checkpointing": True, "torch_compile": True, "torch_compile_mode": "reduce-overhead"},
            r"`torch_compile_mode: reduce-overhead` \(CUDA graphs\) with `activation_offload_layers` is not supported",
        ),
    ],
    ids=["no-checkpointing", "fsdp2", "cuda-graphs"],
)
def test_activation_offload_layers_is_refused_where_it_cannot_work(tmp_path, overrides, message):
    from hellbender.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, activation_offload_layers=1, **overrides))


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_offloaded_checkpointing_is_refused_under_cuda_graphs_and_not_without(tmp_path, mode):
    from hellbender.errors import ConfigError

    raw = base_config(tmp_path, gradient_checkpointing="offload", torch_compile=True)
    with pytest.raises(
        ConfigError, match=f"`torch_compile_mode: {mode}` \\(CUDA graphs\\) with `gradient_checkpointing: offload`"
    ):
        validate_config({**raw, "torch_compile_mode": mode})
    assert validate_config({**raw, "torch_compile_mode": "max-autotune-no-cudagraphs"}).torch_compile


def test_hellbender_train_checkpoints_only_the_layers_asked_for(tmp_path):
    seen: list[list[bool]] = []

    class Flags(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append([layer.gradient_checkpointing for layer in decoder_layers(model.get_base_model())])

    cfg = base_config(
        tmp_path, max_steps=2, adapter="lora", gradient_checkpointing=True, gradient_checkpointing_layers=1
    )
    train(validate_config(cfg), callbacks=[Flags()])
    assert seen == [[True, False]]


def test_hellbender_train_offloads_the_layers_asked_for(tmp_path):
    """`activation_offload_layers: 1` of the two checkpointed layers: `train` gives the first layer the offloaded call
    (run once, its saved tensors through the offloader) and leaves the second checkpointed."""
    seen: list[list[str]] = []

    class Calls(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            layers = decoder_layers(model.get_base_model())
            seen.append([layer._gradient_checkpointing_func.__qualname__.split(".")[0] for layer in layers])

    cfg = base_config(tmp_path, max_steps=2, adapter="lora", gradient_checkpointing=True, activation_offload_layers=1)
    train(validate_config(cfg), callbacks=[Calls()])
    assert seen == [["offloaded_layer_function", "checkpoint_function"]]


def test_lora_with_checkpointing_on_a_model_adding_to_its_embeddings_in_place(tmp_path):
    """GIT adds its position embeddings to the word embeddings' output in place. Frozen embeddings (LoRA) give an
    output without grad; forcing it to require grad (transformers' `enable_input_require_grads`) made that a leaf
    torch refuses to change in place. Non-reentrant checkpointing needs no such input: the adapter gradients are
    the ones of the run without checkpointing."""
    from transformers import GitConfig, GitForCausalLM

    from hellbender.models.adapters import apply_adapter

    cfg = validate_config(base_config(tmp_path, adapter="lora", lora_target_linear=True))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = GitConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vision_config={**vision, "image_size": 32, "patch_size": 16},
    )
    ids = torch.arange(3, 15).unsqueeze(0)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = apply_adapter(cfg, GitForCausalLM(config))
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        model(input_ids=ids).logits.float().pow(2).mean().backward()  # GIT's own loss expects image tokens
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    reached = [{n for n, g in run.items() if g is not None} for run in grads]
    assert reached[0] == reached[1] and any(".encoder.layer." in n for n in reached[1])  # the text decoder's layers
    for name in reached[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
