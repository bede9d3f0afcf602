"""A time and size budget for rendering a chat template, so that a template that never ends (nested loops over
large ranges, a macro that recurses without end) or renders an enormous text is refused instead of hanging the run.

Templates render in transformers' own sandboxed Jinja environment (`apply_chat_template` compiles each template once,
in its `_compile_jinja_template` cache). That environment routes every call, attribute and item access of a template
through its `call`, `getattr` and `getitem` methods, and joins every piece of output (the template's and each macro's)
with its `concat`. Those four are wrapped on that one environment instance (the class and other templates are left
alone) to check the budget of the render in progress: the clock, and the length of each text being joined. Outside a
budgeted render (inference, other callers) the wrappers only pass through. The budget is a context variable, so it
works on any thread and in every `dataset.map` worker process, where a signal alarm would not.

Not covered: a loop with an empty body that only iterates a list already built (no call, access or output happens
in it to check), and one Python operation that allocates a huge value at once (`'x' * 10**10`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from hellbender.errors import EnvironmentProblem

RENDER_SECONDS = 10.0  # one conversation renders in milliseconds; this is orders of magnitude more
RENDER_CHARACTERS = 64 * 1024 * 1024  # longer than any sequence_len in tokens could use


class RenderBudgetExceeded(Exception):
    """A render ran past its time or size budget; the message says which."""


@dataclass(frozen=True)
class _Budget:
    deadline: float
    seconds: float
    characters: int


_ACTIVE: ContextVar[_Budget | None] = ContextVar("hellbender_render_budget", default=None)
_MARK = "_hellbender_render_budget"  # set on an environment whose methods are wrapped


def _check_clock(budget: _Budget) -> None:
    if time.monotonic() > budget.deadline:
        raise RenderBudgetExceeded(f"rendering one conversation took more than {budget.seconds:g} seconds")


def _joined(pieces: Iterable[str], budget: _Budget) -> str:
    out, length = [], 0
    for piece in pieces:
        length += len(piece)
        if length > budget.characters:
            raise RenderBudgetExceeded(
                f"the rendered text of one conversation grew past {budget.characters:,} characters"
            )
        _check_clock(budget)
        out.append(piece)
    return "".join(out)


def _wrap(env: Any) -> None:
    call, getattr_, getitem, concat = env.call, env.getattr, env.getitem, env.concat

    def budgeted_call(context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        if (budget := _ACTIVE.get()) is not None:
            _check_clock(budget)
        return call(context, obj, *args, **kwargs)

    def budgeted_getattr(obj: Any, attribute: str) -> Any:
        if (budget := _ACTIVE.get()) is not None:
            _check_clock(budget)
        return getattr_(obj, attribute)

    def budgeted_getitem(obj: Any, argument: Any) -> Any:
        if (budget := _ACTIVE.get()) is not None:
            _check_clock(budget)
        return getitem(obj, argument)

    def budgeted_concat(pieces: Iterable[str]) -> str:
        budget = _ACTIVE.get()
        return concat(pieces) if budget is None else _joined(pieces, budget)

    env.call, env.getattr, env.getitem, env.concat = budgeted_call, budgeted_getattr, budgeted_getitem, budgeted_concat
    setattr(env, _MARK, True)


def install(template: str) -> None:
    """Wrap the environment transformers renders `template` in (compiled and cached once per process)."""
    from jinja2.sandbox import SandboxedEnvironment

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        _compile_jinja_template = None
    if _compile_jinja_template is None:
        raise EnvironmentProblem(
            "The installed transformers has no `transformers.utils.chat_template_utils._compile_jinja_template`, "
            "which hellbender uses to bound the time and size of chat-template rendering. Install a transformers "
            "release hellbender is tested with (5.17 or 5.24)."
        )
    env = _compile_jinja_template(template).environment
    if getattr(env, _MARK, False):
        return
    if not isinstance(env, SandboxedEnvironment):
        raise EnvironmentProblem(
            "The installed transformers renders chat templates outside Jinja's sandbox, which hellbender relies on "
            "to bound rendering. Install a transformers release hellbender is tested with (5.17 or 5.24)."
        )
    _wrap(env)


def render_within_budget(
    template: str, render: Callable[[], str], seconds: float | None = None, characters: int | None = None
) -> str:
    """`render()` (which renders `template` through transformers) under the budget (default RENDER_SECONDS and
    RENDER_CHARACTERS); raises `RenderBudgetExceeded`."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    characters = RENDER_CHARACTERS if characters is None else characters
    install(template)
    token = _ACTIVE.set(_Budget(time.monotonic() + seconds, seconds, characters))
    try:
        text = render()
    finally:
        _ACTIVE.reset(token)
    if len(text) > characters:  # a single value output whole (`'x' * n`) is only seen here
        raise RenderBudgetExceeded(f"the rendered text of one conversation is longer than {characters:,} characters")
    return text
