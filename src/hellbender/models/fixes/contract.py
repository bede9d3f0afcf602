"""What a fix relies on in the installed libraries, checked when the fix is applied.

A fix that overrides or calls a private transformers method keeps working only while transformers still has that
method: when a release renames it, the override is never called and the call fails far from the fix, or the fix
silently does nothing. Each fix therefore lists its requirements (the class that must have the attribute, the
attribute, why the fix needs it) in a `Contract`, and checks it when it is applied. Overrides are checked on the
*parent* class: a subclass still "has" a method it overrides after the parent dropped it, which is the silent case.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hellbender.errors import EnvironmentProblem

# The transformers releases hellbender's fixes are tested with (CPU CI, and the GPU machines).
TESTED_TRANSFORMERS = ("5.17", "5.24")


@dataclass(frozen=True)
class Requirement:
    owner: type
    name: str
    why: str
    parameters: tuple[str, ...] = ()  # parameters the fix passes by name, when it calls `owner.name`

    def problem(self) -> str | None:
        """What is missing, or None when the installed library meets this requirement."""
        where = f"`{self.owner.__module__}.{self.owner.__qualname__}.{self.name}`"
        if not hasattr(self.owner, self.name):
            return f"{where} does not exist (hellbender uses it: {self.why})"
        if not self.parameters:
            return None
        try:
            accepted = inspect.signature(getattr(self.owner, self.name)).parameters
        except (TypeError, ValueError):
            return f"{where} has no signature hellbender can read (hellbender calls it: {self.why})"
        missing = [p for p in self.parameters if p not in accepted]
        if missing:
            return f"{where} takes no {', '.join(f'`{p}`' for p in missing)} (hellbender passes it: {self.why})"
        return None


@dataclass(frozen=True)
class Contract:
    """The requirements of one fix (`fix` names it in the error)."""

    fix: str
    requirements: tuple[Requirement, ...]

    def check(self) -> None:
        problems = [p for p in (r.problem() for r in self.requirements) if p is not None]
        if not problems:
            return
        import transformers

        raise EnvironmentProblem(
            f"{self.fix} relies on transformers internals that transformers {transformers.__version__} does not "
            f"have: {'; '.join(problems)}. Without them the fix would silently stop applying, so hellbender stops "
            f"here. Install a transformers release hellbender is tested with ({', '.join(TESTED_TRANSFORMERS)}: "
            f"`pip install 'transformers=={TESTED_TRANSFORMERS[-1]}.*'`), or report this transformers version to "
            "hellbender so the fix can be updated."
        )
