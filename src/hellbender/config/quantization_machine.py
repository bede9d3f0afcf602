"""Whether this machine can run a `qat:` / `quantization:` scheme: torchao installed, and the GPU (and kernel package)
its torchao kernels need. A config may be validated on a laptop and run on a GPU server, so `validate` notes the
problem and `train` / `quantize` stop on it (`machine_needs.py`)."""

from __future__ import annotations

import importlib.util
from typing import Any

from hellbender.config.quantization import SCHEMES, QuantizationScheme

INSTALL = "pip install 'hellbender[qat]'"  # torchao, in the version the tests ran against


def torchao_installed() -> bool:
    try:
        return importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError):
        return False


def _cuda_capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


# What each scheme's torchao kernels need beyond torch itself: (CUDA compute capability, extra module, why).
_NEEDS: dict[tuple[str, str | None], tuple[tuple[int, int] | None, str | None]] = {
    ("int8", None): (None, None),
    ("int4", "int8"): (None, None),
    ("int4", None): ((8, 0), "mslk"),
    ("int4", "float8"): ((8, 9), "mslk"),
    ("float8", "float8"): ((8, 9), None),
    ("nvfp4", None): ((10, 0), None),
    ("nvfp4", "nvfp4"): ((10, 0), None),
    ("mxfp4", "mxfp4"): ((10, 0), None),
}


def machine_problem(scheme: QuantizationScheme, key: str, capability: Any = "this machine") -> str | None:
    """Why this machine cannot run `key:`'s scheme (torchao missing, no GPU of the kind its kernels need), or None.
    `capability`: a CUDA compute capability (or None for no GPU) in place of this machine's, for tests."""
    if not torchao_installed():
        return (
            f"`{key}:` quantizes with torchao, which is not installed: `{INSTALL}` (or `pip install torchao`) in "
            f"the environment that trains, then run again; or remove `{key}:`."
        )
    pair = (scheme.weight_dtype, scheme.activation_dtype)
    needed, module = _NEEDS[pair]
    have = _cuda_capability() if capability == "this machine" else capability
    name = SCHEMES[pair]
    if needed is not None and (have is None or tuple(have) < needed):
        gpu = "no CUDA GPU" if have is None else f"a CUDA GPU of compute capability {have[0]}.{have[1]}"
        return (
            f"`{key}:` asks for {name}, whose torchao kernels need a CUDA GPU of compute capability "
            f"{needed[0]}.{needed[1]} or newer, and this machine has {gpu}. Quantize on such a GPU, or choose a "
            f"scheme that runs anywhere: `weight_dtype: int8` (weight-only) or `weight_dtype: int4` with "
            "`activation_dtype: int8`."
        )
    if module is not None and importlib.util.find_spec(module) is None:
        return (
            f"`{key}:` asks for {name}, whose int4 kernels torchao takes from the `{module}` package, which is not "
            f"installed: `pip install {module}`, or choose `activation_dtype: int8` with `weight_dtype: int4`."
        )
    return None
