"""Run a library's patch of a built model so that it changes that model only.

Liger patches an already-built model in two ways at once: on the model's own modules (a bound `forward` on each
norm and MLP instance, on the model) and in transformers itself, for the whole process: module-level classes and
functions (`modeling_llama.LlamaRMSNorm`, `modeling_llama.apply_rotary_pos_emb`) and class attributes
(`LlamaForCausalLM.forward`). A model built later in the same process (DPO's reference model, a distillation
teacher) would silently be patched too. `patch_one_model` runs the patch, puts back every module global and class
attribute it changed, and gives the model's own modules what those changes did for them:

- a replaced class attribute (a method) is bound on each of the model's modules that read it from that class;
- a replaced module-level function (transformers' modeling code calls these by global name at run time) reaches
  this model only: each method of the model's classes that reads it, and each function of that module through
  which it is read, is copied with globals that see the replacement, and the copies are bound on the model's
  modules;
- a replaced module-level class only matters when a module is built, so for a built model it is just put back.

Anything else it changed outside the model cannot be scoped this way and is refused (`CannotScope`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_MISSING = object()  # an attribute that did not exist (before) or no longer exists (after)


class CannotScope(Exception):
    """The patch changed something outside the model that cannot be moved onto the model alone."""


def _watched(name: str) -> bool:
    # What Liger's entry points write to: transformers' modules, and torch.nn (`modeling_x.nn.LayerNorm = ...`).
    return name == "transformers" or name.startswith("transformers.") or name in ("torch.nn", "torch.nn.functional")


@dataclass(frozen=True)
class Change:
    owner: types.ModuleType | type
    name: str
    old: Any
    new: Any

    def __str__(self) -> str:
        owner = self.owner.__name__ if isinstance(self.owner, types.ModuleType) else _qualified(self.owner)
        return f"`{owner}.{self.name}`"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Snapshot:
    """Shallow copies of the namespaces a patch may change: watched modules, the classes they define, the classes
    the model's modules are made of, and the model's modules themselves."""

    def __init__(self, model: Any) -> None:
        self.modules = {n: m for n, m in list(sys.modules.items()) if m is not None and _watched(n)}
        classes: dict[type, None] = {}
        for name, module in self.modules.items():
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    classes[value] = None
        for module in model.modules():
            classes.update(dict.fromkeys(type(module).__mro__[:-1]))
        self.module_dicts = {name: dict(vars(module)) for name, module in self.modules.items()}
        self.class_dicts = {cls: dict(vars(cls)) for cls in classes}
        self.instance_dicts = {name: (module, dict(vars(module))) for name, module in model.named_modules()}

    def changes(self) -> list[Change]:
        found = []
        for name, module in self.modules.items():
            found += _differences(module, self.module_dicts[name], vars(module))
        for cls, before in self.class_dicts.items():
            found += _differences(cls, before, vars(cls))
        return found

    def instance_changes(self) -> list[str]:
        return [
            f"{path or '<model>'}.{key}"
            for path, (module, before) in self.instance_dicts.items()
            for key in sorted(set(before) | set(vars(module)))
            if before.get(key, _MISSING) is not vars(module).get(key, _MISSING)
        ]

    def new_modules(self) -> list[types.ModuleType]:
        return [m for n, m in list(sys.modules.items()) if m is not None and _watched(n) and n not in self.modules]


def _differences(owner: Any, before: dict[str, Any], after: Any) -> list[Change]:
    return [
        Change(owner, key, before.get(key, _MISSING), after.get(key, _MISSING))
        for key in set(before) | set(after)
        if before.get(key, _MISSING) is not after.get(key, _MISSING)
    ]


def _put_back(change: Change) -> None:
    if change.old is _MISSING:
        delattr(change.owner, change.name)
    else:
        setattr(change.owner, change.name, change.old)


def patch_one_model(model: Any, patch: Callable[[], Any], library: str) -> list[str]:
    """Run `patch()` (which patches `model`, and transformers on the way), then undo everything it changed outside
    `model` and move onto `model` what those changes did for it. Returns the attributes of `model`'s modules that
    changed (`"model.layers.0.mlp.forward"`, ...): empty when the patch did nothing to this model.

    `library` is the patching package (`"liger_kernel"`): a transformers module first imported while the patch ran
    has no earlier state to compare with, so it is refused if it holds anything of `library`'s."""
    before = _Snapshot(model)
    try:
        patch()
    except BaseException:
        for change in before.changes():
            _put_back(change)
        raise
    changes = before.changes()
    try:
        bindings = _bindings_for(model, changes, before)  # read while the patched classes are still in place
    finally:
        for change in changes:
            _put_back(change)
    foreign = [f"`{m.__name__}.{k}`" for m in before.new_modules() for k, v in _namespace(m) if _from(v, library)]
    if foreign:
        raise CannotScope(f"{', '.join(foreign)} (in a module first imported while {library} patched the model)")
    for module, name, value in bindings:
        vars(module)[name] = value
    return before.instance_changes()


def _namespace(module: types.ModuleType) -> Iterator[tuple[str, Any]]:
    yield from list(vars(module).items())
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            yield from ((f"{value.__qualname__}.{k}", v) for k, v in list(vars(value).items()))


def _from(value: Any, library: str) -> bool:
    origin = getattr(value, "__module__", None)
    return isinstance(origin, str) and (origin == library or origin.startswith(library + "."))


def _bindings_for(model: Any, changes: list[Change], before: _Snapshot) -> list[tuple[Any, str, Any]]:
    """(module of `model`, attribute, value) to set on the instance so that it behaves as under `changes`."""
    bindings: list[tuple[Any, str, Any]] = []
    replaced_functions: dict[types.ModuleType, dict[str, Any]] = {}
    for change in changes:
        if isinstance(change.owner, type):
            bindings += _class_attribute_bindings(model, change)
        elif change.old is _MISSING or isinstance(change.old, type):
            continue  # a name stock code never read, or a module-level class (only read when a module is built)
        elif change.owner.__name__.startswith("torch."):
            # torch's functions are read as attributes (`nn.functional.cross_entropy`) from everywhere
            raise CannotScope(f"{change} (a torch function)")
        elif callable(change.old) and callable(change.new):
            replaced_functions.setdefault(change.owner, {})[change.name] = change.new
        else:
            raise CannotScope(f"{change} (set to {change.new!r}; it was {_shown(change.old)})")
    for module, replacements in replaced_functions.items():
        bindings += _function_bindings(model, module, before.module_dicts[module.__name__], replacements)
    return bindings


def _shown(value: Any) -> str:
    return "missing" if value is _MISSING else repr(value)


def _class_attribute_bindings(model: Any, change: Change) -> list[tuple[Any, str, Any]]:
    cls, name = change.owner, change.name
    reached = [
        m
        for m in model.modules()
        if isinstance(m, cls) and name not in vars(m) and inspect.getattr_static(type(m), name, None) is change.new
    ]
    if not reached:
        return []
    if not inspect.isfunction(change.new):
        raise CannotScope(f"{change} (set to {change.new!r}, which is not a method)")
    return [(m, name, types.MethodType(change.new, m)) for m in reached]


def _function_bindings(
    model: Any, module: types.ModuleType, unpatched: dict[str, Any], replacements: dict[str, Any]
) -> list[tuple[Any, str, Any]]:
    """Copies of the methods of `model`'s classes that read any of `replacements` from `module`'s globals, bound
    on `model`'s modules; the copies read `module`'s unpatched globals, except for the replaced names."""
    own = vars(module)
    namespace = {**unpatched, **replacements}
    names = set(replacements)
    # A function of `module` that reads a replaced name is replaced in the namespace by a copy that reads the
    # namespace, so that a method calling it reaches the replacement too (repeated until nothing more is found).
    while found := {
        key: value
        for key, value in unpatched.items()
        if key not in names and inspect.isfunction(value) and _reads(value, own, names)
    }:
        names |= set(found)
        for key, value in found.items():
            namespace[key] = _copy(value, own, namespace, names)
    copies: dict[int, Any] = {}  # one copy per method, bound to each instance

    def copy_of(value: Any) -> Any:
        if id(value) not in copies:
            function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            reads = inspect.isfunction(function) and _reads(function, own, names)
            copies[id(value)] = _copy(function, own, namespace, names) if reads else None
        return copies[id(value)]

    bindings: list[tuple[Any, str, Any]] = []
    for instance in model.modules():
        for cls in type(instance).__mro__[:-1]:
            for attribute, value in list(vars(cls).items()):
                if (copy := copy_of(value)) is None:
                    continue
                if attribute in vars(instance) or inspect.getattr_static(type(instance), attribute) is not value:
                    continue  # the instance has its own (the patch's), or a subclass overrides this one
                if isinstance(value, staticmethod):
                    bound: Any = copy
                elif isinstance(value, classmethod):
                    bound = types.MethodType(copy, type(instance))
                else:
                    bound = types.MethodType(copy, instance)
                bindings.append((instance, attribute, bound))
    return bindings


def _chain(function: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """`function` and the functions in its closure (a decorator keeps the function it wraps there)."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return
    seen.add(id(function))
    yield function
    for cell in function.__closure__ or ():
        if _filled(cell) and inspect.isfunction(cell.cell_contents):
            yield from _chain(cell.cell_contents, seen)


@functools.cache
def _code_names(code: types.CodeType) -> frozenset[str]:
    """The global (and attribute) names `code` and the functions defined in it read."""
    names = frozenset(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _code_names(constant)
    return names


def _reads(function: Any, globals_: dict, names: set[str]) -> bool:
    return any(f.__globals__ is globals_ and _code_names(f.__code__) & names for f in _chain(function))


def _copy(function: Any, globals_: dict, namespace: dict, names: set[str], active: frozenset[int] = frozenset()) -> Any:
    """A copy of `function` that looks up its globals in `namespace` where it looked them up in `globals_`;
    functions it wraps are copied the same way, so a decorated method keeps its decorator."""
    active = active | {id(function)}
    closure = function.__closure__
    if closure:
        closure = tuple(
            types.CellType(_copy(c.cell_contents, globals_, namespace, names, active))
            if _filled(c)
            and inspect.isfunction(c.cell_contents)
            and id(c.cell_contents) not in active  # (a function that refers to itself keeps the original)
            and _reads(c.cell_contents, globals_, names)
            else c
            for c in closure
        )
    copy = types.FunctionType(
        function.__code__,
        namespace if function.__globals__ is globals_ else function.__globals__,
        function.__name__,
        function.__defaults__,
        closure,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = function.__qualname__, function.__doc__, function.__module__
    copy.__annotations__ = function.__annotations__
    copy.__dict__.update(function.__dict__)
    wrapped = function.__dict__.get("__wrapped__")
    if inspect.isfunction(wrapped) and _reads(wrapped, globals_, names):
        copy.__wrapped__ = next((f for f in _chain(copy) if f.__code__ is wrapped.__code__), wrapped)
    return copy


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a cell whose variable is not assigned yet
        return False
    return True
