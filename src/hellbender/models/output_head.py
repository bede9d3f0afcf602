"""A causal LM's last step, from its final hidden states to its logits, taken out of the model's forward so that a
loss can run it a chunk of positions at a time and the [tokens x vocabulary] logits never exist at once.

A forward pre-hook on the model's output embeddings keeps the hidden states they are given and lets the model
project only the last position. The model's own logits of that position then check, once, that `logits` here
reproduces how the model turns hidden states into logits (its final soft-capping included); a family that scales
or transforms its logits in another way is refused by name instead of trained on a different loss. Generic over
families: it relies only on the model calling its output embeddings module on the final hidden states, which the
check confirms too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from hellbender.errors import ConfigError

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
        self._checked = False
        module.register_forward_pre_hook(self._keep_hidden)

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

    def hidden_states(self, last_logits: torch.Tensor) -> torch.Tensor:
        """The final hidden states [B, T, H] the last forward within `capturing` kept; `last_logits` is what that
        forward returned as logits ([B, 1, V]), checked against `logits` the first time."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            raise ConfigError(
                f"`{self.key}`: {self.role} ({self.model_type}) computes its logits without calling its output layer "
                f"module, so they cannot be computed in chunks. Set `{self.key}: false`."
            )
        if not self._checked:
            self._check(hidden[..., -1:, :], last_logits)
        return hidden

    @torch.no_grad()
    def _check(self, hidden: torch.Tensor, theirs: torch.Tensor) -> None:
        ours = self.logits(hidden).float()
        theirs = theirs.float()
        # Wide enough for 16-bit rounding of one matrix product; a scale or another transform is far outside it.
        tolerance = 2e-2 * theirs.abs().max().clamp_min(1.0)
        if ours.shape != theirs.shape or not bool(((ours - theirs).abs() <= tolerance).all()):
            raise ConfigError(
                f"`{self.key}`: {self.role} ({self.model_type}) turns its last hidden states into logits in a way the "
                "chunked computation does not reproduce (a logit scale or another transform after its output layer), "
                f"so the loss would differ from the model's own. Set `{self.key}: false`."
            )
        self._checked = True

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
