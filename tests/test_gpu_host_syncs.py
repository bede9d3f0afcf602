"""A training step that neither logs, evaluates nor saves never makes the host wait for the GPU, nor does the
distillation loss more than once.

Every wait (a `.item()`, `int(tensor)`, `bool(tensor)`, a copy to the host) lets the GPU run dry while the host
catches up with the next kernels. CUDA's sync debug mode reports each one; these tests run real steps with it on and
name the code that waited.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from hellbender.config import validate_config
from hellbender.models import output_head
from hellbender.models.output_head import chunked_head
from hellbender.train.distillation_loss import DistillationLoss, distillation_loss
from hellbender.train.fused_distillation_loss import fused_distillation_loss
from hellbender.train.run import train
from tests import test_fused_distillation as fused
from tests.helpers import base_config, logged_losses

pytestmark = pytest.mark.gpu

TORCH_DIR = str(Path(torch.__file__).parent)
# hellbender's code, and accelerate's copies of each batch to the GPU (asynchronous under hellbender's defaults).
OWN_WAITS = ("/hellbender/", "/accelerate/")


class HostSyncs(TrainerCallback):
    """Records every synchronising CUDA call from the start of optimizer step `first` to the start of step `last`
    (the steps in between, their ends included), each with the innermost caller outside torch."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.syncs: list[tuple[int, str, str]] = []  # (step, innermost caller outside torch, the stack below it)
        self._catching: warnings.catch_warnings | None = None
        self._step = 0

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing CUDA operation" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(TORCH_DIR)]
        frames = [f for f in frames if f.filename != __file__ and "/warnings.py" not in f.filename]
        caller = frames[-1]
        shown = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
        self.syncs.append((self._step, f"{caller.filename}:{caller.lineno}", shown))

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step + 1
        if self._step == self.first:
            self._catching = warnings.catch_warnings()
            self._catching.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        elif self._step == self.last and self._catching is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catching.__exit__(None, None, None)
            self._catching = None

    def report(self) -> str:
        return "\n".join(f"step {step}: {shown}" for step, _, shown in self.syncs)


@pytest.mark.parametrize(
    "keys",
    [
        dict(adapter="lora", lora_target_linear=True),
        dict(sample_packing=True, gradient_accumulation_steps=2, gradient_checkpointing=True),
    ],
    ids=["lora", "full, packed, accumulated, checkpointed"],
)
def test_steps_that_neither_log_nor_save_never_wait_for_the_gpu(tmp_path, keys):
    """Steps 2-7 of 8, logged at steps 1 and 8 and saved at step 8: neither hellbender's own code (token counting,
    the divergence check) nor the batch copies its settings make asynchronous wait for the GPU there. What still
    waits, outside hellbender's reach, is printed: transformers' SDPA mask builder reads whether a batch is padded or
    packed (one or two waits per micro-batch)."""
    cfg = validate_config(base_config(tmp_path, bf16=True, max_steps=8, logging_steps=8, save_steps=8, **keys))
    syncs = HostSyncs(first=2, last=8)
    train(cfg, callbacks=[syncs])
    assert list(logged_losses(cfg.output_dir)) == [1, 8]
    print(syncs.report())
    ours = [s for s in syncs.syncs if any(owner in s[1] for owner in OWN_WAITS)]
    assert not ours, "hellbender waits for the GPU in a step that neither logs nor saves:\n" + syncs.report()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole logits"])
def test_the_distillation_loss_waits_for_the_gpu_once(monkeypatch, chunked):
    """Forward and backward over six chunks (or the whole logits): the host waits once, to learn how many positions
    are trained. Selecting the positions with a target by a boolean mask waited four times a chunk, and once more in
    each chunk's backward."""
    monkeypatch.setattr(output_head, "CHUNK_LOGITS", fused.VOCAB * 4)
    model = fused.tiny("llama").cuda()
    ids, labels, targets = (t.cuda() if torch.is_tensor(t) else [x.cuda() for x in t] for t in fused.batch())
    settings, items = DistillationLoss(alpha=0.9, ce_alpha=0.1), torch.tensor(30, device="cuda")
    head = chunked_head(model, "the student", fused.KEY, required=True) if chunked else None
    if head is not None:
        with head.capturing():
            model(input_ids=ids)
        hidden = head.hidden_states()
    else:
        logits = model(input_ids=ids).logits
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            if head is not None:
                parts = fused_distillation_loss(head, hidden, labels, *targets, settings, items)
            else:
                parts = distillation_loss(logits, labels, *targets, settings, items)
            parts.loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [str(w.message) for w in caught if "synchronizing CUDA operation" in str(w.message)]
    assert len(waits) == 1, waits
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0
