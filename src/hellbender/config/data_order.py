"""Combinations of the keys that choose which prepared rows are kept and in what order they are trained
(`dataset_exact_deduplication`, `min_sample_len`, `group_by_length`, `sample_packing_sequentially`,
`curriculum_sampling`) that cannot work. Checked before the derived defaults: a null key was not written."""

from __future__ import annotations

from hellbender.config.schema import HellbenderConfig


def _prepared_only(cfg: HellbenderConfig, key: str, what: str) -> list[str]:
    """`key` acts on prepared rows: streamed rows and rows used as they are never pass through preparation."""
    if cfg.uses_streaming:
        return [
            f"`{key}` {what}, and a streamed `pretraining_dataset` is read lazily while training, never prepared: "
            f"set `streaming: false` to prepare it, or remove `{key}`."
        ]
    if cfg.skip_prepare_dataset:
        return [
            f"`{key}` {what}, and `skip_prepare_dataset: true` uses the rows as they are, without preparing them: "
            f"remove one of the two."
        ]
    return []


def data_order_problems(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []
    if cfg.dataset_exact_deduplication:
        problems += _prepared_only(cfg, "dataset_exact_deduplication", "drops duplicates while the data is prepared")
    # The default drops nothing beyond what every route drops (a row under 2 tokens has nothing to train).
    if cfg.min_sample_len > type(cfg).model_fields["min_sample_len"].default:
        problems += _prepared_only(cfg, "min_sample_len", "drops short rows while the data is prepared")
        if cfg.min_sample_len > cfg.sequence_len:
            problems.append(
                f"`min_sample_len: {cfg.min_sample_len}` is more than `sequence_len: {cfg.sequence_len}`, so every "
                "row would be dropped (a longer row is dropped or truncated to `sequence_len`). Lower "
                "`min_sample_len`, or raise `sequence_len`."
            )
    packs = cfg.sample_packing or cfg.eval_sample_packing or (cfg.sample_packing is None and cfg.uses_streaming)
    if cfg.group_by_length:
        problems += _prepared_only(cfg, "group_by_length", "groups prepared rows by their length")
        if cfg.sample_packing:
            problems.append(
                "`group_by_length` cannot work with `sample_packing`: packed bins are all filled to about "
                "`sequence_len`, so there are no lengths to group (packing already avoids the padding that grouping "
                "saves). Remove one of the two."
            )
        if cfg.curriculum_sampling:
            problems.append(
                "`group_by_length` and `curriculum_sampling` contradict each other: one reorders the rows by length, "
                "the other trains them in dataset order. Remove one."
            )
    if cfg.sample_packing_sequentially and not packs:
        problems.append(
            "`sample_packing_sequentially: true` chooses how rows are packed, and nothing is packed: add "
            "`sample_packing: true`, or remove `sample_packing_sequentially`."
        )
    if cfg.curriculum_sampling:
        if cfg.uses_streaming:
            problems.append(
                "`curriculum_sampling` trains rows in dataset order, and a streamed `pretraining_dataset` is read "
                "through a shuffle buffer: set `streaming: false` to prepare it, or remove `curriculum_sampling`."
            )
        if cfg.shuffle_merged_datasets:
            problems.append(
                "`curriculum_sampling` trains rows in dataset order, and `shuffle_merged_datasets: true` shuffles "
                "that order away before training. Remove `shuffle_merged_datasets` (it is off with "
                "`curriculum_sampling`), or remove `curriculum_sampling`."
            )
        if cfg.sample_packing and cfg.sample_packing_sequentially is False:
            problems.append(
                "`curriculum_sampling` trains rows in dataset order, and `sample_packing_sequentially: false` packs "
                "them by best fit, which sorts them by length. Remove `sample_packing_sequentially` (it is on with "
                "`curriculum_sampling`), or remove `curriculum_sampling`."
            )
    return problems
