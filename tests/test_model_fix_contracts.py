"""Every fix that overrides or calls transformers internals refuses to apply when one of them is gone, naming it.

The installed transformers is changed in place for one test (monkeypatch undoes it): each requirement of each
contract is deleted from the class that defines it, as a transformers release that renamed it would have it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import transformers
from transformers import AutoModelForCausalLM

from hellbender.errors import EnvironmentProblem
from hellbender.models import activation_checkpointing
from hellbender.models.fixes import gemma4, qwen2_5_vl
from hellbender.models.fixes.contract import Contract, Requirement
from hellbender.models.tiny import tiny_model_dir


def load_gemma4_processor() -> Any:
    return gemma4.load_processor(tiny_model_dir("hellbender/tiny-gemma4-vlm"))


def load_qwen_processor() -> Any:
    return qwen2_5_vl.load_processor(tiny_model_dir("hellbender/tiny-qwen2.5-vl"))


def enable_checkpointing() -> Any:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-llama"))
    return activation_checkpointing.enable_activation_checkpointing(model)


# Each contract, with the call that applies its fix.
APPLIED_BY: dict[str, tuple[Contract, Callable[[], Any]]] = {
    "gemma4-processor": (gemma4.PROCESSOR_CONTRACT, load_gemma4_processor),
    "qwen2_5_vl-processor": (qwen2_5_vl.PROCESSOR_CONTRACT, load_qwen_processor),
    "activation-checkpointing": (activation_checkpointing.CONTRACT, enable_checkpointing),
}
CASES = [
    pytest.param(contract, apply, requirement, id=f"{name}-{requirement.name}")
    for name, (contract, apply) in APPLIED_BY.items()
    for requirement in contract.requirements
]


@pytest.fixture(autouse=True)
def without_torchvision(monkeypatch):
    """The processor fixes apply only where torchvision is missing (elsewhere `AutoProcessor` loads the stock
    processor), so the tests take that path on every machine."""
    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)


def remove(owner: type, name: str, monkeypatch) -> None:
    """`owner.name` no longer exists, as in a release that renamed it (deleted from every class that defines it)."""
    for cls in owner.__mro__:
        if name in vars(cls):
            monkeypatch.delattr(cls, name)
    assert not hasattr(owner, name)


@pytest.mark.parametrize("contract, apply", [pytest.param(c, a, id=n) for n, (c, a) in APPLIED_BY.items()])
def test_each_fix_applies_with_the_installed_transformers(contract, apply):
    contract.check()
    assert apply() is not None


# (`__init__` and `__call__` always exist, inherited from `object`; their contract is their parameters.)
@pytest.mark.parametrize("contract, apply, requirement", [c for c in CASES if not hasattr(object, c.values[2].name)])
def test_a_missing_attribute_is_refused_by_name(contract, apply, requirement, monkeypatch):
    remove(requirement.owner, requirement.name, monkeypatch)
    with pytest.raises(EnvironmentProblem) as refused:
        apply()
    message = str(refused.value)
    assert f"{requirement.owner.__qualname__}.{requirement.name}` does not exist" in message
    assert f"transformers {transformers.__version__}" in message
    assert contract.fix in message and "pip install 'transformers==" in message


@pytest.mark.parametrize("contract, apply, requirement", [case for case in CASES if case.values[2].parameters])
def test_a_method_that_no_longer_takes_a_parameter_is_refused_by_name(contract, apply, requirement, monkeypatch):
    dropped = requirement.parameters[-1]

    def narrower(self, *args, **kwargs):  # stands in for the method of a release that dropped `dropped`
        raise AssertionError("the fix called the method although its contract is not met")

    original = inspect.signature(getattr(requirement.owner, requirement.name))
    narrower.__signature__ = original.replace(parameters=[p for n, p in original.parameters.items() if n != dropped])
    monkeypatch.setattr(requirement.owner, requirement.name, narrower)
    with pytest.raises(EnvironmentProblem, match=f"{requirement.name}` takes no `{dropped}`"):
        apply()


def test_an_override_of_a_method_the_parent_lost_is_refused_though_the_subclass_still_has_it(monkeypatch):
    """The silent case: the fix's subclass still defines `_process_videos`, transformers' class no longer does."""
    remove(transformers.Gemma4Processor, "_process_videos", monkeypatch)
    assert hasattr(gemma4.Gemma4ProcessorWithoutVideo, "_process_videos")
    with pytest.raises(EnvironmentProblem, match=r"Gemma4Processor\._process_videos` does not exist"):
        load_gemma4_processor()


@pytest.mark.parametrize(
    "fix_class, contract",
    [
        (gemma4.Gemma4ProcessorWithoutVideo, gemma4.PROCESSOR_CONTRACT),
        (qwen2_5_vl.ImageOnlyQwen2_5_VLProcessor, qwen2_5_vl.PROCESSOR_CONTRACT),
    ],
)
def test_every_method_a_fix_overrides_is_in_its_contract(fix_class, contract):
    """An override added later without declaring it would be unchecked."""
    parent = fix_class.__mro__[1]
    overridden = {
        name
        for name, value in vars(fix_class).items()
        if (inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)))
        and hasattr(parent, name)
        and (not name.startswith("__") or name in ("__init__", "__call__"))
    }
    declared = {r.name for r in contract.requirements if r.owner is parent}
    assert overridden <= declared, overridden - declared


def test_a_contract_lists_every_problem_at_once():
    class Stock:
        def present(self, a):
            pass

    contract = Contract(
        "a fix",
        (
            Requirement(Stock, "present", "called", parameters=("a", "b")),
            Requirement(Stock, "gone", "overridden"),
        ),
    )
    with pytest.raises(EnvironmentProblem) as refused:
        contract.check()
    assert "Stock.present` takes no `b`" in str(refused.value)
    assert "Stock.gone` does not exist" in str(refused.value)
