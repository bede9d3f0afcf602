"""FSDP1 configs (Axolotl's `fsdp:` option list and FSDP1's `fsdp_config` keys) translated to the FSDP2 settings they
mean, as accelerate's FSDP1-to-FSDP2 migration maps them, with one notice line saying what became what.

`fsdp_version: 1`, asked for explicitly, is not translated: it is refused (hellbender shards with FSDP2 only). So are
FSDP1 settings FSDP2 has no counterpart for (`no_shard`, forward prefetch) and FSDP1's hybrid sharding, whose group
size depends on the machines (`dp_shard_size` says it for FSDP2).
"""

from __future__ import annotations

from typing import Any

# `fsdp:` options -> the fsdp_config settings they become (None: refused, with the reason)
OPTIONS: dict[str, tuple[dict[str, Any] | None, str]] = {
    "full_shard": ({"reshard_after_forward": True}, ""),
    "shard_grad_op": ({"reshard_after_forward": False}, ""),
    "auto_wrap": ({"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, ""),
    "offload": ({"offload_params": True}, ""),
    "no_shard": (None, "it does not shard at all: train with DDP (`--nproc N` without `fsdp_version`)"),
    "hybrid_shard": (
        None,
        "FSDP1 shards within each machine and replicates across machines, whose size the config does not say: set "
        "`dp_shard_size` to the GPUs per machine (FSDP2 hybrid sharding) instead",
    ),
    "hybrid_shard_zero2": (
        None,
        "it keeps the gathered parameters between forward and backward within hybrid sharding; use `dp_shard_size` "
        "(the GPUs per machine) with `fsdp_config.reshard_after_forward: false` instead",
    ),
}
SHARDING_STRATEGIES = {
    "FULL_SHARD": "full_shard",
    "SHARD_GRAD_OP": "shard_grad_op",
    "NO_SHARD": "no_shard",
    "HYBRID_SHARD": "hybrid_shard",
    "_HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
}
# FSDP1 settings with no meaning under FSDP2: it always prefetches backward, needs no all-gather limit, always keeps
# the original parameters (FSDP1's `use_orig_params: false` flattened them) and starts every process from the same
# weights (`sync_module_states`)
BUILT_IN = ("backward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states")


def translate_fsdp1(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rewrite FSDP1 keys in `raw` to FSDP2's. Returns (problems, notices)."""
    options = raw.get("fsdp")
    fsdp_config = raw.get("fsdp_config")
    problems: list[str] = []
    if isinstance(fsdp_config, dict):
        _version_to_top_level(raw, fsdp_config, problems)
    # `fsdp_version: 1`, asked for explicitly, is refused by validation, not translated.
    if raw.get("fsdp_version") == 1 or not (options or isinstance(fsdp_config, dict)):
        return problems, []
    if not isinstance(fsdp_config, dict):
        fsdp_config = {}
    translated: dict[str, Any] = {}
    words = options.split() if isinstance(options, str) else list(options or [])
    strategy = _pop(fsdp_config, "sharding_strategy")
    if strategy is not None:
        words.append(SHARDING_STRATEGIES.get(str(strategy).upper(), str(strategy)))
    for word in words:
        setting, why = OPTIONS.get(str(word), (None, "it is not an FSDP option hellbender knows"))
        if setting is None:
            problems.append(f"`fsdp`: `{word}` cannot be translated to FSDP2: {why}.")
            continue
        for key, value in setting.items():
            if key in translated and translated[key] != value:
                problems.append(f"`fsdp`: `{word}` contradicts another FSDP option (both set `{key}`); keep one.")
            translated[key] = value
    # Under an explicit `fsdp_version: 2` FSDP2's own keys stay for validation (which refuses what FSDP2 cannot do);
    # an FSDP1 config's settings that FSDP2 makes moot are dropped.
    from_fsdp1 = bool(options) or raw.get("fsdp_version") is None
    dropped = [key for key in BUILT_IN if from_fsdp1 and _pop(fsdp_config, key) is not None]
    forward_prefetch = _pop(fsdp_config, "forward_prefetch")
    if forward_prefetch:
        problems.append("`fsdp_config.forward_prefetch: true` has no FSDP2 counterpart in accelerate; remove it.")
    if not (words or dropped or forward_prefetch is not None):
        return problems, []  # FSDP2 settings already: nothing to translate
    for key, value in translated.items():
        if _pop(fsdp_config, key) not in (None, value):
            problems.append(f"`fsdp_config.{key}` contradicts the FSDP1 option that sets it to {value}; keep one.")
        fsdp_config[key] = value
    raw.pop("fsdp", None)
    raw["fsdp_version"] = raw.get("fsdp_version") or 2
    raw["fsdp_config"] = fsdp_config
    became = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in translated.items())
    notice = f"FSDP1 settings translated to FSDP2: `fsdp_version: 2`{', ' if became else ''}{became}"
    if dropped:
        notice += f"; {', '.join(f'`{k}`' for k in dropped)} dropped (FSDP2 does that itself)"
    return problems, [notice + "."]


def _version_to_top_level(raw: dict[str, Any], fsdp_config: dict[str, Any], problems: list[str]) -> None:
    """Axolotl also reads `fsdp_version` written inside `fsdp_config`; it is the top-level key."""
    version = _pop(fsdp_config, "version")
    if version is None:
        return
    if raw.get("fsdp_version") not in (None, version):
        problems.append(
            f"`fsdp_config.fsdp_version: {version}` and `fsdp_version: {raw['fsdp_version']}` differ; keep the "
            "top-level `fsdp_version`."
        )
        return
    raw["fsdp_version"] = version


def _pop(fsdp_config: dict[str, Any], key: str) -> Any:
    """The value of `key` or its `fsdp_`-prefixed spelling, removed from `fsdp_config`."""
    for name in (key, f"fsdp_{key}"):
        if name in fsdp_config:
            return fsdp_config.pop(name)
    return None
