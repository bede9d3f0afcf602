"""Validate every config in a folder of Axolotl configs (e.g. the `examples/` folder of an Axolotl checkout) and
print how many hellbender accepts unchanged, and what stops the others, grouped by why:

- planned: every blocker belongs to a feature hellbender plans (preference tuning, MoE training, ...);
- not offered: a blocker is a feature hellbender deliberately does not offer (the refusal says why);
- package missing: a blocker is an optional package this machine lacks (e.g. DeepSpeed);
- config mistake: a blocker is a mistake in the config itself, which Axolotl would also fail on or silently ignore:
  a key neither hellbender nor Axolotl defines (a typo, a leftover), a file the config names that does not exist
  (e.g. a reward-function file the example expects the user to write), or a placeholder left in a value;
- other: anything else (what this script exists to find).

    python scripts/axolotl_examples.py PATH/TO/axolotl/examples [--list]

Runs offline: validation reads no model or data (a config naming a missing local file is refused for that).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import tempfile
from pathlib import Path

from hellbender.config import load_config
from hellbender.config.unsupported import not_offered_reason, planned_feature
from hellbender.errors import ConfigError

# Refusal wordings of mistakes in the config itself: unknown keys, missing files it names, placeholder values.
MISTAKE_WORDS = re.compile(
    r"is not a config key|is not a key of hellbender, nor of Axolotl|, and there is no file |"
    r"is not a Hugging Face Hub repository id.*\(got '<"
)
# Refusal wordings of planned features that are not keys of their own (dataset types, plugins, key values).
PLANNED_WORDS = re.compile(
    r"is a preference-data format|does not run user transform functions|which hellbender does not offer yet"
)


def blockers(error: ConfigError) -> list[tuple[str, str]]:
    """(the key a problem paragraph names, its group) for each paragraph of a refusal."""
    found = []
    for paragraph in str(error).split("\n\n"):
        named = re.search(r"`([^`]+)`", paragraph)
        key = named.group(1).split(":")[0].strip() if named else paragraph[:60]
        leaf = key.split(".")[-1]
        if "package, which is not installed" in paragraph:
            group = "package missing"
        elif planned_feature(leaf) or PLANNED_WORDS.search(paragraph):
            group = "planned"
        elif not_offered_reason(leaf) or "is not offered" in paragraph:
            group = "not offered"
        elif MISTAKE_WORDS.search(paragraph):
            group = "config mistake"
        else:
            group = "other"
        found.append((key if group == "other" else leaf, group))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--list", action="store_true", help="also print each refused config with its blockers")
    args = parser.parse_args()
    logging.getLogger("hellbender").setLevel(logging.ERROR)  # notices are not blockers
    files = sorted(p for p in args.folder.resolve().rglob("*.y*ml") if "archived" not in p.parts)
    os.chdir(tempfile.mkdtemp())  # relative output paths of the configs land here
    outcome: dict[Path, list[tuple[str, str]]] = {}
    for path in files:
        try:
            load_config(path)
            outcome[path] = []
        except ConfigError as error:
            outcome[path] = blockers(error)
    groups = collections.Counter()
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for found in outcome.values():
        kinds = {group for _, group in found}
        order = ("other", "config mistake", "not offered", "package missing", "planned")
        worst = next((g for g in order if g in kinds), "accepted")
        groups[worst] += 1
        counts.update(set(found))
    total = len(files)
    print(f"{total} configs in {args.folder}")
    for name in ("accepted", "planned", "package missing", "not offered", "config mistake", "other"):
        print(f"  {name:<16} {groups[name]:4d}  ({groups[name] / total:.0%})")
    print(f"accepted, or refused only for planned features: {(groups['accepted'] + groups['planned']) / total:.1%}")
    passing = groups["accepted"] + groups["planned"] + groups["not offered"] + groups["package missing"]
    print(f"... or also for features not offered (with the reason) or a missing package: {passing / total:.1%}")
    print(f"... or also for a mistake in the config: {(passing + groups['config mistake']) / total:.1%}")
    print("blockers (configs each stops):")
    for (key, group), count in counts.most_common():
        print(f"  {count:4d}  {group:<16} {key}")
    if args.list:
        for path, found in outcome.items():
            if found:
                print(f"{path.relative_to(args.folder.resolve())}: {', '.join(sorted({k for k, _ in found}))}")


if __name__ == "__main__":
    main()
