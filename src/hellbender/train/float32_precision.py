"""Torch's float32 matmul precision, kept readable by torch's own code after transformers sets it.

transformers (5.x, under torch 2.9 or newer) turns TF32 on or off through torch's per-backend API
(`torch.backends.fp32_precision`) while the Trainer's arguments are built: for `tf32: true`, and on its own when the
Trainer compiles the whole model in bf16. After such a write torch's legacy readers
(`torch.get_float32_matmul_precision()`, `torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`)
raise a "mix of the legacy and new APIs" error, and torch's own code still reads through them: inductor's
autotuning cache keys (`torch_compile_mode: max-autotune*`), flex attention's precision choice, convolution lowering
(PyTorch pull request 189955 lists them). Saying the same precision again through the legacy setters makes both
APIs agree; the per-backend values stay as transformers set them.
"""

from __future__ import annotations


def legacy_readers_raise() -> bool:
    """Whether torch's legacy float32-precision readers refuse to answer (the state was written the new way)."""
    import torch

    try:
        torch.get_float32_matmul_precision()
        _ = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    except RuntimeError:
        return True
    return False


def restate_for_legacy_readers() -> None:
    """Where the legacy readers raise, set the precision the per-backend API holds again through the legacy setters:
    TF32 matmuls as `high` (else `highest`), cuDNN's TF32 as its convolutions have it."""
    if not legacy_readers_raise():
        return
    import torch

    matmul_in_tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
    torch.set_float32_matmul_precision("high" if matmul_in_tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.conv.fp32_precision == "tf32"
