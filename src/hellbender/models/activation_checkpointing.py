"""Activation checkpointing, with one rule enforced: nothing that crosses a checkpoint boundary is a mutable
container.

A checkpointed layer call keeps the function it will replay in backward, keyword arguments included. When one of
those arguments is a mutable container that layers fill with tensors (Gemma 4's shared K/V dict), the replay
function holds the container, the container holds tensors, and their autograd graph holds the replay function:
a reference cycle that only Python's garbage collector breaks, so the tensors can outlive the step (under FSDP2
this leaked about 0.47 GiB per step on Gemma 4 31B until it ran out of memory).

Here such arguments go around the checkpointed call instead: `SideChannel`, one per model instance, holds them
under a ticket; the replayed function carries only the ticket (an int) and fetches them when it runs, from
whatever thread autograd runs it on. The channel is emptied when the model starts its next forward and after every
training step's backward, so nothing of one step survives into the next. It is only used where transformers
checkpoints: a layer in training mode with gradients enabled.

With `torch_compile`, compilation is regional: the checkpoint call of each layer is compiled, so dynamo traces torch's
checkpoint into its activation-checkpoint operator and the compiled layer saves what checkpointing saves (its inputs)
and recomputes the rest in backward. The routing above and the offload hooks run around the compiled call: dynamo
cannot trace saved-tensor hooks, and the offloader then parks exactly what the compiled layer saves.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, MutableMapping, MutableSequence, MutableSet
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from hellbender.models.activation_offload import ActivationOffloader
from hellbender.models.fixes.contract import Contract, Requirement
from hellbender.models.fixes.reformer import refuse_checkpointing_reversible_layers
from hellbender.models.layer_list_checkpointing import checkpoint_layer_modules, per_layer_modules

MUTABLE_CONTAINERS = (MutableMapping, MutableSequence, MutableSet)
CHANNEL_ATTRIBUTE = "hellbender_checkpoint_side_channel"
OFFLOADER_ATTRIBUTE = "hellbender_activation_offloader"

# The transformers internals `enable_activation_checkpointing` works through, checked each time it is called.
CONTRACT = Contract(
    "hellbender's activation checkpointing",
    (
        Requirement(
            PreTrainedModel,
            "_set_gradient_checkpointing",
            "called to give every layer hellbender's checkpoint function",
            parameters=("enable", "gradient_checkpointing_func"),
        ),
        Requirement(
            GradientCheckpointingLayer,
            "gradient_checkpointing",
            "each decoder layer's own switch, turned off for layers beyond `gradient_checkpointing_layers`",
        ),
    ),
)


class SideChannel:
    """Arguments of checkpointed calls that must not be captured by the replay function, for one model.

    A plain instance attribute, so every thread sees it (autograd replays checkpointed layers on its worker
    threads); one per model, so two models in one process (policy and reference, student and teacher) never read
    each other's arguments; entries are keyed by ticket, so every layer call reads its own arguments."""

    def __init__(self) -> None:
        self._entries: dict[int, dict[str | int, Any]] = {}
        self._tickets = itertools.count()

    def deposit(self, arguments: dict[str | int, Any]) -> int:
        ticket = next(self._tickets)
        self._entries[ticket] = arguments
        return ticket

    def fetch(self, ticket: int) -> dict[str | int, Any]:
        try:
            return self._entries[ticket]
        except KeyError:
            raise RuntimeError(
                "A checkpointed layer was replayed in backward after its model started another forward (or after "
                "the training step ended), so the arguments it was called with are gone. Run backward before the "
                "model's next forward, or switch `gradient_checkpointing` off for this use."
            ) from None

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _ReplayWithSideChannel:
    """The layer call given to torch's checkpoint, minus its mutable arguments: it fetches them by ticket each
    time it runs (the forward, and the replay in backward). It holds the channel weakly, so the autograd graph
    never references the containers, even indirectly."""

    __slots__ = ("args", "channel", "func", "keywords", "ticket")

    def __init__(self, func: Callable, args: tuple, keywords: dict, channel: SideChannel, ticket: int) -> None:
        self.func, self.args, self.keywords = func, args, keywords
        self.channel = weakref.ref(channel)
        self.ticket = ticket

    def __call__(self, *args: Any) -> Any:
        channel = self.channel()
        if channel is None:
            raise RuntimeError("The model whose checkpointed layer is being replayed no longer exists.")
        routed = channel.fetch(self.ticket)
        positional = [routed.get(i, arg) for i, arg in enumerate(args)]
        keywords = {k: v for k, v in routed.items() if isinstance(k, str)}
        return self.func(*self.args, *positional, **self.keywords, **keywords)


def checkpoint_function(
    channel: SideChannel | None,
    offloader: ActivationOffloader | None,
    compile_options: dict[str, Any] | None = None,
    offload_inputs: bool = True,
) -> Callable[..., Any]:
    """What each checkpointed layer calls as `_gradient_checkpointing_func(layer_call, *args)`.

    Always non-reentrant: reentrant checkpointing runs the forward without a graph, so a layer reading K/V that an
    earlier layer stored (Gemma 4) sends no gradient back to it. With an `offloader`, each layer's saved inputs
    wait in host memory until backward (`offload_inputs=False`: they stay on the device, and the offloader only
    learns where backward is). `channel=None` turns the routing off (for comparison in tests). `compile_options`
    (keyword arguments of `torch.compile`) compile the checkpoint call; every layer of a class shares the compiled
    code."""
    checkpointed = _checkpointed if compile_options is None else torch.compile(_checkpointed, **compile_options)

    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        if channel is not None:
            function, args = _route_mutable_arguments(function, args, channel)
        with offloader.hooks(offload_inputs) if offloader is not None else nullcontext():
            return checkpointed(function, *args, **kwargs)

    return run


def _checkpointed(function: Callable, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def offloaded_layer_function(
    offloader: ActivationOffloader, compile_options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """What a layer of `activation_offload_layers` calls in place of a checkpoint: the layer runs once, and all it
    saves for backward waits in host memory, so backward does not recompute it. Nothing is replayed, so mutable
    arguments need no routing. `compile_options` compile the layer call, as for checkpointed layers."""
    call = _call if compile_options is None else torch.compile(_call, **compile_options)

    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        with offloader.hooks():
            return call(function, *args, **kwargs)

    return run


def _call(function: Callable, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def _transformers_checkpoints(model: Any) -> bool:
    """The model's layers are transformers' checkpointing layers (else hellbender checkpoints its per-layer modules)."""
    return any(isinstance(module, GradientCheckpointingLayer) for module in model.modules())


def _decoder_layers(model: Any) -> list[Any]:
    layers = [m for m in model.get_decoder().modules() if isinstance(m, GradientCheckpointingLayer)]
    return layers or per_layer_modules(model)  # else a model whose per-layer modules hellbender checkpoints itself


def layers_left_unchecked(model: Any, count: int) -> list[Any]:
    """The language model's decoder layers after the first `count` (a `gradient_checkpointing_layers` of `count`
    leaves them unchecked); refuses a count above the number of decoder layers. Works on a meta-device skeleton,
    so the count is checked before any data work."""
    decoder_layers = _decoder_layers(model)
    if count > len(decoder_layers):
        from hellbender.errors import ConfigError

        raise ConfigError(
            f"`gradient_checkpointing_layers: {count}`, but {type(model).__name__} has {len(decoder_layers)} decoder "
            f"layers. Set it to {len(decoder_layers)} or less (or remove it to checkpoint every layer)."
        )
    return decoder_layers[count:]


def check_layer_counts(cfg: Any, model: Any) -> None:
    """Refuses `gradient_checkpointing_layers` / `activation_offload_layers` counts `model` (a meta-device skeleton
    will do) cannot take: `train` before its data work, `validate` where the model's config can be read."""
    if cfg.gradient_checkpointing_layers is not None:
        layers_left_unchecked(model, cfg.gradient_checkpointing_layers)
    if cfg.activation_offload_layers:
        offloaded_layers(model, cfg.gradient_checkpointing_layers, cfg.activation_offload_layers)


def offloaded_layer_indices(checkpointed: int, offloaded: int) -> list[int]:
    """Which of the first `checkpointed` decoder layers `activation_offload_layers: offloaded` offloads: spread
    evenly from the first, so the checkpointed layers between two of them give each one's copies time to run (to
    host in forward, back in backward), and the topmost checkpointed layer's backward starts the first fetch."""
    return [i * checkpointed // offloaded for i in range(offloaded)]


def offloaded_layers(model: Any, checkpointed: int | None, offloaded: int) -> list[Any]:
    """The decoder layers `activation_offload_layers: offloaded` runs offloaded instead of checkpointed; refuses more
    than are checkpointed. Works on a meta-device skeleton, so the count is checked before any data work."""
    from hellbender.errors import ConfigError

    if not _transformers_checkpoints(model):
        raise ConfigError(
            f"`activation_offload_layers` is set, but {type(model).__name__}'s layers are not ones transformers "
            "checkpoints, and hellbender offloads only those. Remove `activation_offload_layers`."
        )
    decoder_layers = _decoder_layers(model)
    count = len(decoder_layers) if checkpointed is None else checkpointed
    if offloaded > count:
        raise ConfigError(
            f"`activation_offload_layers: {offloaded}` offloads that many of the checkpointed layers, and "
            f"{type(model).__name__} checkpoints {count} (`gradient_checkpointing_layers`, default all "
            f"{len(decoder_layers)}). Set it to {count} or less, or checkpoint more layers."
        )
    return [decoder_layers[i] for i in offloaded_layer_indices(count, offloaded)]


def _route_mutable_arguments(function: Callable, args: tuple, channel: SideChannel) -> tuple[Callable, tuple]:
    keywords = function.keywords if isinstance(function, partial) else {}
    routed: dict[str | int, Any] = {k: v for k, v in keywords.items() if isinstance(v, MUTABLE_CONTAINERS)}
    routed.update({i: arg for i, arg in enumerate(args) if isinstance(arg, MUTABLE_CONTAINERS)})
    if not routed:
        return function, args
    ticket = channel.deposit(routed)
    if isinstance(function, partial):
        plain = {k: v for k, v in keywords.items() if k not in routed}
        replay = _ReplayWithSideChannel(function.func, function.args, plain, channel, ticket)
    else:
        replay = _ReplayWithSideChannel(function, (), {}, channel, ticket)
    return replay, tuple(None if i in routed else arg for i, arg in enumerate(args))


def enable_activation_checkpointing(
    model: Any,
    offload: bool = False,
    side_channel: bool = True,
    layers: int | None = None,
    compile_options: dict[str, Any] | None = None,
    offload_layers: int = 0,
) -> SideChannel:
    """Checkpoint every decoder layer of `model` (a transformers model, or a PEFT model around one) with
    `checkpoint_function`, or only the first `layers` decoder layers of its language model, and return the model's
    side channel. `offload_layers` of the checkpointed layers run once instead, their saved tensors in host memory
    (`offloaded_layer_function`). `side_channel=False` captures mutable arguments in the replay function as
    transformers does by default (for comparison in tests). `compile_options` (keyword arguments of
    `torch.compile`) compile each checkpointed layer call, and each decoder layer left unchecked as a module."""
    CONTRACT.check()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own_layers = _layers_transformers_cannot_checkpoint(base)
    channel = SideChannel()
    offloader = ActivationOffloader() if offload or offload_layers else None
    checkpointed = checkpoint_function(
        channel if side_channel else None, offloader, compile_options, offload_inputs=offload
    )
    if own_layers is not None:
        checkpoint_layer_modules(own_layers[:layers], checkpointed)
    else:
        base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpointed)
    if offload_layers:
        run_offloaded = offloaded_layer_function(offloader, compile_options)
        for layer in offloaded_layers(base, layers, offload_layers):
            layer._gradient_checkpointing_func = run_offloaded  # transformers calls each layer's own
    if layers is not None and own_layers is None:
        for layer in layers_left_unchecked(base, layers):  # transformers reads each layer's own flag
            layer.gradient_checkpointing = False
            if compile_options is not None:
                layer.compile(**compile_options)  # in place: parameter names, and so saved weights, stay as they are
    if getattr(base.config, "use_cache", None):
        base.config.use_cache = False
    # No `enable_input_require_grads` (transformers' habit for reentrant checkpointing): non-reentrant checkpointing
    # reaches the adapter weights inside a layer whose input needs no grad, and the hook turns the frozen embeddings'
    # output into a leaf that requires grad, which models adding to it in place (GIT's position embeddings) refuse.
    setattr(model, CHANNEL_ATTRIBUTE, channel)
    # Only a forward that will be back-propagated starts a new step: a forward without gradients between a training
    # forward and its backward (preference tuning's reference pass through the same model with the adapter off) must
    # leave that step's routed arguments and parked activations in place.
    model.register_forward_pre_hook(lambda module, args: channel.clear() if torch.is_grad_enabled() else None)
    if offloader is not None:
        setattr(model, OFFLOADER_ATTRIBUTE, offloader)
        model.register_forward_pre_hook(lambda module, args: offloader.new_step() if torch.is_grad_enabled() else None)
    return channel


def _layers_transformers_cannot_checkpoint(base: Any) -> list[list[Any]] | None:
    """None where transformers checkpoints the model's layers itself (its `GradientCheckpointingLayer`s, also in
    JetMoE, whose class says it does not support checkpointing: its gradients are the same with and without, tested);
    else the per-layer modules hellbender checkpoints, or a refusal where there are none."""
    if _transformers_checkpoints(base):
        return None
    refuse_checkpointing_reversible_layers(base.config)
    layers = per_layer_modules(base)
    if not layers:
        from hellbender.errors import ConfigError

        raise ConfigError(
            f"`gradient_checkpointing` is set, but {type(base).__name__} does not support activation checkpointing "
            "and keeps no per-layer module lists hellbender could checkpoint. Set `gradient_checkpointing: false`."
        )
    return layers


def side_channel_of(model: Any) -> SideChannel | None:
    return getattr(model, CHANNEL_ATTRIBUTE, None)


def offloader_of(model: Any) -> ActivationOffloader | None:
    return getattr(model, OFFLOADER_ATTRIBUTE, None)
