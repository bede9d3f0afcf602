"""`hellbender train CONFIG`, killed with SIGKILL at a chosen point: the process the fault-injection test runs.

    python tests/crash_run.py CONFIG [--events LOG] [--kill-at-event N] [--kill-in-step STEP --delay-ms MS]
                                     [--kill-before-step STEP]

- `--events LOG` appends one line per file-system write under the config's run directory (the parent of
  `output_dir`): `kind<TAB>path`, where kind is open / mkdir / rename / remove / rmdir. The uninterrupted
  reference run records them, so the test can choose kill points among them.
- `--kill-at-event N` kills the process at the N-th such write (0-based), before it happens.
- `--kill-in-step STEP --delay-ms MS` kills it MS milliseconds into optimizer step STEP (1-based).
- `--kill-before-step STEP` kills it as optimizer step STEP begins (its batches already fetched), at a point that
  does not depend on timing: everything the steps before it wrote, checkpoints included, is complete.

Writes are observed through Python's audit hooks, so they include what Python code writes (json, torch.save,
datasets' metadata, renames, directory creation and removal); bytes written by native code (safetensors, Arrow)
are covered by the open / rename events around them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
EVENT_KINDS = {
    "os.mkdir": "mkdir",
    "os.rename": "rename",
    "os.remove": "remove",
    "os.rmdir": "rmdir",
    "shutil.rmtree": "rmdir",
}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def watch_writes(root: Path, log_path: Path | None, kill_at: int | None) -> None:
    root_text = str(root)
    log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 - open for the process's life
    count = 0
    busy = threading.local()

    def hook(event: str, args: tuple) -> None:
        nonlocal count
        if getattr(busy, "on", False):
            return
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & WRITE_FLAGS
            )
            kind = "open" if writes else None
        else:
            kind = EVENT_KINDS.get(event)
            path = args[0] if args else None
        if kind is None or not isinstance(path, (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(path)
        if not path.startswith(root_text):
            return
        busy.on = True
        try:
            if kill_at is not None and count == kill_at:
                die()
            if log is not None:
                log.write(f"{kind}\t{path}\n")
            count += 1
        finally:
            busy.on = False

    sys.addaudithook(hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--events")
    parser.add_argument("--kill-at-event", type=int)
    parser.add_argument("--kill-in-step", type=int)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--kill-before-step", type=int)
    options = parser.parse_args()

    import yaml

    root = Path(yaml.safe_load(Path(options.config).read_text())["output_dir"]).parent
    watch_writes(root, Path(options.events) if options.events else None, options.kill_at_event)
    callbacks = []
    if options.kill_in_step is not None:
        from transformers import TrainerCallback

        class KillDuringStep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == options.kill_in_step:
                    threading.Timer(options.delay_ms / 1000, die).start()

        callbacks.append(KillDuringStep())
    if options.kill_before_step is not None:
        from transformers import TrainerCallback

        class KillBeforeStep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == options.kill_before_step:
                    die()

        callbacks.append(KillBeforeStep())

    from hellbender.cli import _run, _setup_logging
    from hellbender.config import load_config
    from hellbender.train.run import train

    def action() -> None:
        _setup_logging()
        train(load_config(options.config), callbacks=callbacks)

    _run(False, action)


if __name__ == "__main__":
    main()
