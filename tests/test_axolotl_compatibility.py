"""Axolotl configs run unchanged: every config in tests/axolotl_configs/ validates as it is, except those that use
keys hellbender does not offer yet (`# blocked_by:` on their first line), which are refused naming exactly those
keys. The accepted share and each remaining blocker are printed (`pytest -s`)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from hellbender.config import load_config
from hellbender.errors import ConfigError

CONFIGS = sorted((Path(__file__).parent / "axolotl_configs").glob("*.yml"))


def blockers(config: Path) -> list[str]:
    first = config.read_text().splitlines()[0]
    assert first.startswith("# blocked_by:"), f"{config.name}: the first line must be `# blocked_by: ...`"
    return [key.strip() for key in first.removeprefix("# blocked_by:").split(",") if key.strip()]


def refusal(config: Path) -> str | None:
    try:
        load_config(config)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_an_axolotl_config_validates_unless_it_uses_what_hellbender_does_not_offer_yet(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # their relative output paths land here
    expected = blockers(config)
    error = refusal(config)
    if not expected:
        assert error is None, f"{config.name} is refused:\n{error}"
        return
    assert error is not None, f"{config.name} validates: remove `{', '.join(expected)}` from its blocked_by line"
    paragraphs = error.split("\n\n")
    for key in expected:
        assert any(f"`{key}" in p for p in paragraphs), f"{config.name}: `{key}` not named in:\n{error}"
    assert len(paragraphs) == len(expected), f"{config.name}: refused for more than {expected}:\n{error}"


def test_the_accepted_share(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    counts = collections.Counter(key for config in CONFIGS for key in blockers(config))
    accepted = sum(1 for config in CONFIGS if not blockers(config))
    with capsys.disabled():
        print(f"\nAxolotl configs accepted unchanged: {accepted} of {len(CONFIGS)} ({accepted / len(CONFIGS):.0%})")
        for key, count in counts.most_common():
            print(f"  blocked by `{key}`: {count}")
    assert len(CONFIGS) >= 12
