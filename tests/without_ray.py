"""The `hellbender` command in a process where `import ray` fails as if Ray were not installed.

python -m tests.without_ray ARGS...      # as `hellbender ARGS...`
"""

from __future__ import annotations

import sys


class HideRay:
    """A meta-path finder that refuses `ray` and its submodules."""

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def main() -> None:
    sys.meta_path.insert(0, HideRay())
    sys.argv = ["hellbender", *sys.argv[1:]]
    from hellbender.cli import main as hellbender_main

    hellbender_main()


if __name__ == "__main__":
    main()
