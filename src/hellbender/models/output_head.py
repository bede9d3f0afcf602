"""A causal LM's last step, from its final hidden states to its logits, taken out of the model's forward so that a
loss can run it a chunk of positions at a time and the [tokens x vocabulary] logits never exist at once.

A forward pre-hook on the model's output embeddings keeps the hidden states they are given and lets the model
project only the last position. Before training, a forward of two tokens compares the model's own logits of its last
position with `logits` here (its final soft-capping included): a family that scales or transforms its logits in
another way, or computes them without calling its output layer, cannot take this path (`chunked_head` says why).
Generic over families: it relies only on the model calling its output embeddings module on the final hidden states,
which the probe confirms.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from hellbender.errors import ConfigError

logger = logging.getLogger("hellbender")

# Positions per chunk: about 2^27 logits (512 MiB in float32) whatever the vocabulary.
CHUNK_LOGITS = 2**27


class OutputHead:
    """The output embeddings of `model` (a plain `nn.Linear`), with the model's final logit soft-capping."""

    def __init__(self, model: Any, role: str, key: str) -> None:
        """`role` names the model in errors ("the student"); `key` is the config key that turns this path off."""
        self.role, self.key = role, key
        self.model_type = model.config.model_type
        module = model.get_output_embeddings()
        if type(module) is not torch.nn.Linear:
            raise ConfigError(
                f"`{key}`: {role}'s output layer is a {type(module).__name__}, not a plain linear layer (an adapter "
                "or quantization on `lm_head`?), so its logits cannot be computed in chunks. Set `"
                f"{key}: false`, or leave `lm_head` out of the adapter."
            )
        self.module = module
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self._active = False
        self._hidden: torch.Tensor | None = None
        self._hook = module.register_forward_pre_hook(self._keep_hidden)

    def _keep_hidden(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self._active:
            return None
        self._hidden = args[0]
        return (args[0][..., -1:, :], *args[1:])

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Within: the model's forward keeps its final hidden states here and returns logits of the last position
        only."""
        self._active, self._hidden = True, None
        try:
            yield
        finally:
            self._active = False

    def hidden_states(self) -> torch.Tensor:
        """The final hidden states [B, T, H] the last forward within `capturing` kept."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            raise ConfigError(
                f"`{self.key}`: {self.role} ({self.model_type}) computes its logits without calling its output layer "
                f"module, so they cannot be computed in chunks. Set `{self.key}: false`."
            )
        return hidden

    @torch.no_grad()
    def probe(self, model: Any) -> None:
        """A ConfigError unless `logits` reproduces `model`'s own logits of a two-token input's last position."""
        device = self.module.weight.device
        with self.capturing():
            theirs = model(input_ids=torch.tensor([[0, 1]], device=device)).logits.float()
        ours = self.logits(self.hidden_states()[..., -1:, :]).float()
        # Wide enough for 16-bit rounding of one matrix product; a scale or another transform is far outside it.
        tolerance = 2e-2 * theirs.abs().max().clamp_min(1.0)
        if ours.shape != theirs.shape or not bool(((ours - theirs).abs() <= tolerance).all()):
            raise ConfigError(
                f"`{self.key}`: {self.role} ({self.model_type}) turns its last hidden states into logits in a way the "
                "chunked computation does not reproduce (a logit scale or another transform after its output layer), "
                f"so the loss would differ from the model's own. Set `{self.key}: false`."
            )

    def remove(self) -> None:
        self._hook.remove()

    def chunks(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`hidden` [N, H] cut into chunks of positions whose logits hold about `CHUNK_LOGITS` values each."""
        return hidden.split(max(1, CHUNK_LOGITS // self.module.weight.shape[0]))

    def logits(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model's logits of `hidden` [..., H], with this module's weight and bias unless others are given (the
        same tensors, detached for a chunk's own autograd graph)."""
        logits = F.linear(
            hidden, self.module.weight if weight is None else weight, self.module.bias if bias is None else bias
        )
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def chunked_head(model: Any, role: str, key: str, required: bool) -> OutputHead | None:
    """`model`'s `OutputHead` once a probe shows its chunks compute the model's logits. Where they cannot: the
    ConfigError that says why when `required` (the key set to true), else None, and a log line: the whole logits."""
    head = None
    try:
        head = OutputHead(model, role, key)
        head.probe(model)
    except ConfigError as exc:
        if head is not None:
            head.remove()
        if required:
            raise
        logger.info("%s: whole logits, not chunks (%s)", key, str(exc).split(": ", 1)[-1])
        return None
    return head
