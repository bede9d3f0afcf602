#!/usr/bin/env bash
# Install the packages hellbender needs that the GPU machines lack (datasets, dill, multiprocess, pydantic,
# bitsandbytes, ...) from the wheels in .whl/ into a target directory, without the network, and print the
# `export PYTHONPATH=...` line to run next (or: eval "$(bash bench/setup_gpu.sh)").
# .whl/ is git-ignored: bring it along to the device machine (e.g. the run tool's `carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target="${1:-/tmp/site}"
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]} == 0)); then
    echo "no wheels in $PWD/.whl: copy them there first" >&2
    exit 1
fi
# --upgrade replaces what an earlier run left in the target instead of refusing it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "${wheels[@]}" >&2
pythonpath="$target:$PWD/src:$PWD"
# Import what the benchmarks need, so a missing dependency shows up here rather than minutes into a run.
PYTHONPATH="$pythonpath" python3 - >&2 <<'PY'
import importlib

missing = []
for name in ("torch", "transformers", "peft", "accelerate", "safetensors", "datasets", "pydantic", "yaml", "PIL",
             "hellbender", "bitsandbytes", "trl"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # bitsandbytes raises more than ImportError when its CUDA library does not load
        missing.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
print("setup_gpu.sh: every package imports" if not missing else "setup_gpu.sh: NOT importable: " + "; ".join(missing))
PY
echo "export PYTHONPATH=$pythonpath"
