"""Hybrid sharding's group sizes (`dp_replicate_size` x `dp_shard_size`), read from the config: what training
builds its device mesh from (train/fsdp.py) and what the planner divides each GPU's state by (plan/settings.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hellbender.errors import ConfigError

if TYPE_CHECKING:
    from hellbender.config import HellbenderConfig


def hybrid_shape(cfg: HellbenderConfig, processes: int) -> tuple[int, int] | None:
    """(replicate, shard) group sizes of hybrid sharding over `processes`, or None for plain FSDP2 (one group
    sharded over all processes). The size left out is what the other leaves; the product must be `processes`."""
    shard, replicate = cfg.dp_shard_size, cfg.dp_replicate_size
    if not cfg.uses_fsdp2 or (shard is None and replicate is None):
        return None
    if shard is None:
        shard = processes // replicate if processes % replicate == 0 else 0
    if replicate is None:
        replicate = processes // shard if processes % shard == 0 else 0
    if shard * replicate != processes or shard < 2:
        raise ConfigError(
            f"`dp_shard_size` ({cfg.dp_shard_size or 'unset'}) x `dp_replicate_size` ({cfg.dp_replicate_size or 'unset'}) "
            f"must equal the number of training processes, {processes}, with groups of 2 or more to shard over. Set "
            f"them so that their product is {processes}, or start as many processes as they describe."
        )
    if replicate > 1 and cfg.fp32_norms:
        raise ConfigError(
            f"`fp32_norms` with hybrid sharding ({replicate} replicas of `dp_shard_size: {shard}`) is not supported yet: "
            "the norm groups would be sharded over all processes while the layers are sharded within groups. Use one "
            "of them."
        )
    return (replicate, shard) if replicate > 1 else None
