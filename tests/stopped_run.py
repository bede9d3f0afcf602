"""`train(CONFIG)` in a process of its own, as a user's interrupted and resumed runs are: stopped after an optimizer
step, or run to the end (resuming from a checkpoint when the config says so).

    python -m tests.stopped_run CONFIG [--stop-at STEP] [--record REPORT.json]

`--record` writes what the run trained on and which image files it opened (`tests.helpers.record_training`) to
REPORT.json. Run from the repository root, so that `tests` is importable.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--stop-at", type=int, help="stop once this many optimizer steps are done")
    parser.add_argument("--record", type=Path, help="write the record of the run here (JSON)")
    options = parser.parse_args()

    from hellbender.config import load_config
    from hellbender.train.run import train
    from tests.helpers import StopAt, record_training

    record = record_training(setattr) if options.record else None
    train(load_config(options.config), callbacks=[StopAt(options.stop_at)] if options.stop_at else None)
    if options.record:
        options.record.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
