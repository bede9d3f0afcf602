"""The teacher of online knowledge distillation (`kd_teacher_model`): a second model in the training process, in
inference mode, that gives the top-k targets of each batch. It is loaded with transformers' own classes as its own
module objects: kernels hellbender applies to the student are scoped to the student's modules
(`models/one_model_patch.py`), so nothing mutable is shared. `hellbender distill-logprobs` computes its offline
targets with the same code, so online and offline targets agree."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hellbender.data.collator import forward_kwargs
from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK
from hellbender.errors import ConfigError
from hellbender.models.output_head import chunked_head
from hellbender.models.packed_attention import packed_attention_mask

KEY = "kd_teacher_model"


def check_teacher_tokenizer(name: str, tokenizer: Any, key: str = KEY) -> str:
    """The teacher's local path or hub id, once its tokenizer is known to be the student's (the same token for
    every id); else a ConfigError naming the teacher."""
    from transformers import AutoTokenizer

    from hellbender.models.loading import resolve_model_path

    source = resolve_model_path(name, key=key)
    try:
        theirs = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"`{key}: {name}`: its tokenizer could not be loaded ({str(exc).splitlines()[0][:160]}). The teacher "
            "must come with its tokenizer, so that hellbender can check it is the student's; save it beside the "
            "model (`tokenizer.save_pretrained`)."
        ) from None
    ours_vocab, theirs_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours_vocab != theirs_vocab:
        differing = sorted(set(ours_vocab.items()) ^ set(theirs_vocab.items()), key=lambda item: item[1])[:3]
        shown = ", ".join(f"{token!r} (id {i})" for token, i in differing)
        raise ConfigError(
            f"`{key}: {name}` uses another tokenizer than the student ({len(theirs_vocab)} tokens against "
            f"{len(ours_vocab)}; not in both alike: {shown}). Distillation compares the two models' distributions "
            "token id by token id, so the teacher must share the student's vocabulary: choose a teacher of the same "
            "family, or remove tokens the config adds (`special_tokens`, `tokens`)."
        )
    return source


class Teacher:
    """A teacher model in inference mode and how many of its tokens per position are targets."""

    def __init__(
        self, model: Any, top_k: int, temperature: float, vocab: int, chunked: bool = False, required: bool = False
    ) -> None:
        """`chunked`: take the top-k from the teacher's last hidden states a chunk of positions at a time
        (`kd_fused_loss`) where the teacher allows it (`required`: or a ConfigError), so its [tokens x vocabulary]
        logits never exist at once."""
        self.model = model
        self.top_k = top_k
        self.temperature = temperature
        self.vocab = vocab  # targets are ids of the shared tokenizer, below its size
        self.head = chunked_head(model, "the teacher", "kd_fused_loss", required) if chunked else None

    def _forward(self, batch: dict[str, Any]) -> Any:
        device = batch["input_ids"].device
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}
        inputs.update(forward_kwargs(inputs))
        inputs.update(packed_attention_mask(self.model, inputs))
        # No KV cache: nothing reads it, and with padded rows (where `forward_kwargs` leaves the model's default) the
        # teacher would hold every layer's keys and values until its logits are read.
        inputs["use_cache"] = False
        return self.model(**inputs)

    @torch.no_grad()
    def logits(self, batch: dict[str, Any]) -> torch.Tensor:
        """The teacher's logits [B, T, vocab] for a collated batch (padded or packed), in float32."""
        return self._forward(batch).logits[..., : self.vocab].float()

    @torch.no_grad()
    def targets(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per token, as stored targets are prepared: the teacher's top-k token ids and their log-probabilities at
        the temperature, renormalised over the k, and where a target is (every token but the first). Named in a
        profiler's trace, so the teacher's share of a step can be read apart from the student's."""
        with torch.profiler.record_function("hellbender.teacher_targets"):
            return self._targets(batch)

    def _targets(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        if self.head is None:
            return per_token(topk_targets(self.logits(batch), self.top_k, self.temperature))
        with self.head.capturing():
            self._forward(batch)
            hidden = self.head.hidden_states()
        chunks = [
            topk_targets(self.head.logits(part)[..., : self.vocab].float(), self.top_k, self.temperature)
            for part in self.head.chunks(hidden.flatten(0, 1))
        ]
        rows = hidden.shape[:2]
        return per_token({key: torch.cat([c[key] for c in chunks]).unflatten(0, rows) for key in chunks[0]})


def topk_targets(logits: torch.Tensor, top_k: int, temperature: float) -> dict[str, torch.Tensor]:
    """Per position of `logits` [B, T, V]: the top-k ids, their log-softmax over the k at `temperature`, a true mask.
    These predict the next token: `per_token` puts them on the tokens they predict."""
    values, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    logprobs = F.log_softmax(values / temperature, dim=-1)
    return {TARGET_IDS: ids, TARGET_LOGPROBS: logprobs, TARGET_MASK: torch.ones_like(ids, dtype=torch.bool)}


def per_token(predictions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Targets made at each position moved onto the token they predict (one to the right); the first token of each
    row gets none (nothing predicts it)."""
    return {
        key: torch.cat([torch.zeros_like(value[:, :1]), value[:, :-1]], dim=1) for key, value in predictions.items()
    }


def load_teacher(cfg: Any, tokenizer: Any, chunked: bool = False) -> Teacher:
    """The config's `kd_teacher_model`, in inference mode with no gradients, in the config's dtype and attention;
    `chunked` as `Teacher` takes it (required when the config sets `kd_fused_loss: true`)."""
    from transformers import AutoModelForCausalLM

    from hellbender.config.precision import torch_dtype

    source = check_teacher_tokenizer(cfg.kd_teacher_model, tokenizer)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype(cfg), attn_implementation=cfg.attn_implementation
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"Could not load `{KEY}: {cfg.kd_teacher_model}` as a causal language model: "
            f"{str(exc).splitlines()[0][:200]}. Check the path or hub id."
        ) from None
    outputs = model.get_output_embeddings()
    if outputs is not None and outputs.weight.shape[0] < len(tokenizer):
        raise ConfigError(
            f"`{KEY}: {cfg.kd_teacher_model}` predicts {outputs.weight.shape[0]} tokens, fewer than the student's "
            f"tokenizer's {len(tokenizer)}: it cannot give a distribution over the student's tokens."
        )
    model.eval()
    model.requires_grad_(False)
    required = cfg.kd_fused_loss is True
    return Teacher(model, cfg.kd_online_topk, cfg.kd_temperature, len(tokenizer), chunked, required)
