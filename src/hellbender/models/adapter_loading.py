"""A saved adapter loaded whole: every LoRA tensor in the file must end up in the model.

PEFT only warns about saved tensors it cannot place, and their layers then run with initial weights. PEFT 0.21 does
this to linear layers whose names share a part with a module adapted through `target_parameters` (fused experts): it
rewrites keys such as `mlp.shared_experts.gate_proj.lora_A.weight` to `mlp.shared_experts..gate_proj...`, or a dense
layer's `mlp.down_proj` beside the experts' `down_proj`, and then finds no module for them (seen on Laguna, Inkling 2,
Mistral Large 4, DeepSeek-OCR 2 and Unlimited-OCR; tests/test_adapter_reload.py). hellbender copies such a tensor
into the parameter PEFT created for it, under the name PEFT itself gives it when saving, and refuses the adapter if
any tensor still has no place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hellbender.errors import ConfigError


def complete_adapter_load(model: Any, adapter_dir: Path) -> int:
    """Places the LoRA tensors of `adapter_dir` that PEFT left out of `model` (a PeftModel just loaded from it) and
    returns how many; raises when one has no parameter of its shape to go to."""
    import peft
    import torch
    from safetensors.torch import load_file

    saved_file = Path(adapter_dir) / "adapter_model.safetensors"
    if not saved_file.is_file():
        return 0
    saved = {key: tensor for key, tensor in load_file(saved_file).items() if "lora_" in key}
    missing = _not_loaded(model, saved)
    parameters = dict(model.named_parameters())
    placed = 0
    with torch.no_grad():
        for key in missing:
            target = parameters.get(_parameter_name(key, model.active_adapter))
            if target is not None and target.shape == saved[key].shape:
                target.copy_(saved[key])
                placed += 1
    if still := _not_loaded(model, saved):
        raise ConfigError(
            f"PEFT {peft.__version__} loaded the adapter in {adapter_dir} only in part: {len(still)} saved tensor(s) "
            f"did not reach the model (e.g. `{still[0]}`) and have no parameter of their shape to go to, so their "
            "layers would run with initial weights. Load the adapter with the base model it was trained on."
        )
    return placed


def _not_loaded(model: Any, saved: dict[str, Any]) -> list[str]:
    """The saved keys whose tensors the model's adapter state (as PEFT would save it) lacks or holds otherwise."""
    import torch
    from peft.utils import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(model)
    return sorted(
        key
        for key, tensor in saved.items()
        if key not in loaded or not torch.equal(loaded[key].detach().cpu().to(tensor.dtype), tensor)
    )


def _parameter_name(key: str, adapter: str) -> str:
    """The model's parameter name for a saved key: the adapter's name goes after the `lora_*` part
    (`x.lora_A.weight` -> `x.lora_A.default.weight`)."""
    head, _, tail = key.partition(".lora_")
    part, _, rest = tail.partition(".")
    return f"{head}.lora_{part}.{adapter}.{rest}"
