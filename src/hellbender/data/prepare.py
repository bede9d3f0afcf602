"""Prepare the training and evaluation data: load, tokenize, mix, split, pack, and cache.

`prepare_datasets` is the one entry point for map-style data; `preprocess` and `train` both call it, so a
`preprocess` run leaves exactly the cache that `train` then loads without tokenizing again.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hellbender.chat_templates import named_template_text
from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.config.data import is_preference_type
from hellbender.data import cache
from hellbender.data.contexts import format_context
from hellbender.data.dedup import drop_exact_duplicates
from hellbender.data.packing import pack_dataset
from hellbender.data.preference import (
    DROP_PROMPT_TOO_LONG,
    PREFERENCE_FORMAT_VERSION,
    Limits,
    is_kto,
    preference_context,
    tokenize_preference_dataset,
)
from hellbender.data.preference_images import encode_vision_pair, vision_pair_features, vision_preference_context
from hellbender.data.sources import first_non_utf8_line, is_url, load_rows, local_data_files, looks_local
from hellbender.data.teacher_targets import TEACHER_TARGETS_VERSION
from hellbender.data.tokenize import TokenizeStats, tokenize_dataset
from hellbender.data.vision_tokens import processor_fingerprint
from hellbender.errors import DataError


@dataclass
class PreparedData:
    train: Any | None  # datasets.Dataset; None when the training data is streamed
    eval: Any | None
    stats: dict[str, Any]
    cache_dir: Path
    from_cache: bool


def _worker_processes(cfg: HellbenderConfig) -> int | None:
    """`dataset_num_proc` as `datasets` takes it: None runs in this process (1 would start a pool of one)."""
    return cfg.dataset_num_proc if cfg.dataset_num_proc > 1 else None


def row_format(entry: DatasetEntry, columns: list[str], multimodal: bool, where: str) -> str:
    if entry.type == "chat_template" and multimodal:
        return "multimodal_chat"
    kind = entry.type or "pretokenized"
    if kind == "pretokenized" and "input_ids" not in columns:
        what = "is `type: pretokenized`" if "type" in entry.model_fields_set else "has no `type` (so `pretokenized`)"
        raise DataError(
            f"{where} {what} and its rows hold no `input_ids` (columns: {', '.join(columns)}). "
            "Set `type: alpaca`, `chat_template` or `completion`."
        )
    return kind


def tokenize_entries(
    entries: list[DatasetEntry], cfg: HellbenderConfig, tokenizer: Any, processor: Any, names: list[str]
):
    """Load and tokenize each entry (`names` say where each sits in the config, for errors); returns the
    concatenated rows and the summed stats."""
    import datasets

    parts = []
    stats = TokenizeStats()
    for name, entry in zip(names, entries, strict=True):
        where = f"Dataset {name} `{entry.path}`"
        rows = load_rows(entry, where=where)
        if len(rows) == 0:
            raise DataError(f"{where} has no rows. Check the file or the `split`.")
        if is_preference_type(entry.type):
            kept, entry_stats = _tokenize_preference_entry(rows, entry, cfg, tokenizer, processor, where)
            stats.add(entry_stats)
            parts.append(kept)
            continue
        fmt = row_format(entry, rows.column_names, processor is not None, where)
        try:
            kept, entry_stats = tokenize_dataset(
                rows,
                fmt,
                format_context(entry, cfg, tokenizer, processor, where),
                cfg.sequence_len,
                cfg.excess_length_strategy,
                where,
                _worker_processes(cfg),
                min_len=cfg.min_sample_len,
            )
        except UnicodeDecodeError:
            # Arrow reads bytes that are not UTF-8 into text columns; they fail only when a row is decoded.
            raise DataError(_not_utf8(entry, where)) from None
        stats.add(entry_stats)
        parts.append(kept)
    merged = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return merged, stats


def _tokenize_preference_entry(
    rows: Any, entry: DatasetEntry, cfg: HellbenderConfig, tokenizer: Any, processor: Any, where: str
):
    """A preference entry's rows as TRL's trainers take them (`data/preference.py`; with a processor, pairs whose
    prompts hold images, `data/preference_images.py`)."""
    limits = Limits(cfg.sequence_len, cfg.max_prompt_len, cfg.excess_length_strategy, cfg.min_sample_len)
    ctx = preference_context(entry, cfg, tokenizer)
    vision_rows: dict[str, Any] = {}
    if processor is not None:
        ctx, vision = vision_preference_context(entry, cfg, ctx, processor, where)
        vision_rows = {"encode_row": functools.partial(encode_vision_pair, vision=vision),
                       "features": vision_pair_features()}  # fmt: skip
    try:
        return tokenize_preference_dataset(rows, ctx, limits, where, _worker_processes(cfg), **vision_rows)
    except UnicodeDecodeError:
        raise DataError(_not_utf8(entry, where)) from None


def _not_utf8(entry: DatasetEntry, where: str) -> str:
    files = local_data_files(entry, where) if looks_local(entry.path) and not is_url(entry.path) else []
    for f in files:
        bad = first_non_utf8_line(f)
        if bad is not None:
            return (
                f"{where}: `{f}` line {bad[0]} is {bad[1]}; save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
            )
    return f"{where}: the data holds text that is not UTF-8; save the file(s) as UTF-8."


def training_entries(cfg: HellbenderConfig) -> list[DatasetEntry]:
    """`datasets:` plus any `pretraining_dataset:` entries that are prepared rather than streamed (raw text as
    `completion`, raw image+text as `multimodal_pretrain`). None when the training rows are streamed or used
    as they are (`skip_prepare_dataset`)."""
    if cfg.skip_prepare_dataset or cfg.uses_streaming:
        return []
    prepared = [
        DatasetEntry(
            **e.model_dump(exclude={"type", "text_column"}),
            type="multimodal_pretrain" if e.type == "multimodal_pretrain" else "completion",
            text_column=e.text_column,
        )
        for e in cfg.pretraining_dataset
    ]
    return list(cfg.datasets) + prepared


def training_entry_names(cfg: HellbenderConfig) -> list[str]:
    """Where each of `training_entries` sits in the config (`datasets[0]`, `pretraining_dataset[1]`)."""
    if cfg.skip_prepare_dataset or cfg.uses_streaming:
        return []
    names = [f"datasets[{i}]" for i in range(len(cfg.datasets))]
    return names + [f"pretraining_dataset[{i}]" for i in range(len(cfg.pretraining_dataset))]


def _cache_parts(cfg: HellbenderConfig, tokenizer: Any, processor: Any) -> dict[str, Any]:
    settings = [
        "sequence_len",
        "excess_length_strategy",
        "min_sample_len",
        "dataset_exact_deduplication",
        "train_on_inputs",
        "chat_template",
        "chat_template_jinja",
        "sample_packing",
        "eval_sample_packing",
        "sample_packing_sequentially",
        "val_set_size",
        "seed",
        "shuffle_merged_datasets",
        "image_size",
        "image_resize_algorithm",
        "max_image_pixels",
        "vision_tokens_to_mask",
        "cache_images",
    ]
    entries = training_entries(cfg) + cfg.test_datasets
    # Only preference data depends on these, so adding them leaves every other cache's key as it was.
    preference = (
        {
            "version": PREFERENCE_FORMAT_VERSION,
            "max_prompt_len": cfg.max_prompt_len,
            "kto": is_kto(cfg),
            "named_template": named_template_text(cfg.chat_template) if cfg.chat_template else None,
        }
        if any(is_preference_type(e.type) for e in entries)
        else None
    )
    # Only rows carrying a teacher's targets depend on these (their log-probabilities are rescaled when prepared).
    distillation = (
        {"version": TEACHER_TARGETS_VERSION, "kd_temperature": cfg.kd_temperature}
        if any(e.logprobs_field for e in entries)
        else None
    )
    return {
        **({"preference": preference} if preference else {}),
        **({"distillation": distillation} if distillation else {}),
        "datasets": [e.model_dump() for e in training_entries(cfg)],
        "test_datasets": [e.model_dump() for e in cfg.test_datasets],
        "files": [cache.files_fingerprint(e.path) for e in training_entries(cfg) + cfg.test_datasets],
        "tokenizer": cache.tokenizer_fingerprint(tokenizer),
        "processor": processor_fingerprint(processor) if processor is not None else None,
        "settings": {k: getattr(cfg, k) for k in settings},
        # A dataset's named template is applied at formatting time, not on the tokenizer: its text keys the cache.
        "named_templates": {
            e.chat_template: named_template_text(e.chat_template)
            for e in training_entries(cfg) + cfg.test_datasets
            if e.chat_template
        },
    }


def _build(cfg: HellbenderConfig, tokenizer: Any, processor: Any) -> tuple[Any | None, Any | None, dict[str, Any]]:
    """Tokenize, mix, split and pack. The training part is None when training data is streamed."""
    train = train_stats = None
    entries = training_entries(cfg)
    if entries:
        train, train_stats = tokenize_entries(entries, cfg, tokenizer, processor, training_entry_names(cfg))
        if cfg.dataset_exact_deduplication:  # before the split: held-out rows never repeat a training row
            train = drop_exact_duplicates(train, train_stats, _worker_processes(cfg))
        if train_stats.rows_kept == 0:
            raise DataError(
                f"Every training row was dropped ({_reasons(train_stats)}); nothing is left to train on. "
                f"{_drop_hints(train_stats)}"
            )
        if cfg.shuffle_merged_datasets:
            # Shuffled as an index mapping, not rewritten: packing and saving read through it in one pass each
            # (rewriting the rows first took 3 s of a 60 s preparation of 100,000 chats).
            train = train.shuffle(seed=cfg.seed)
    eval_ds = eval_stats = None
    if cfg.test_datasets:
        names = [f"test_datasets[{i}]" for i in range(len(cfg.test_datasets))]
        eval_ds, eval_stats = tokenize_entries(cfg.test_datasets, cfg, tokenizer, processor, names)
        if cfg.dataset_exact_deduplication:
            eval_ds = drop_exact_duplicates(eval_ds, eval_stats, _worker_processes(cfg))
    elif cfg.val_set_size > 0 and train is not None:
        size = cfg.val_set_size if cfg.val_set_size < 1 else int(cfg.val_set_size)
        # The evaluation rows as `train_test_split` counts them (a fraction rounds up), so that a split that would
        # leave no training rows is refused here, by name, instead of inside `datasets`.
        eval_rows = math.ceil(size * len(train)) if size < 1 else size
        if eval_rows >= len(train):
            raise DataError(
                f"`val_set_size: {cfg.val_set_size}` leaves no training rows out of {len(train)}: lower "
                "`val_set_size` (a fraction below 1, or a row count below the number of rows), or add training rows."
            )
        train, eval_ds = _hold_out(train, size, eval_rows, cfg)
    stats = {
        "train": train_stats.to_dict() if train_stats else None,
        "eval": eval_stats.to_dict() if eval_stats else None,
        "train_rows": len(train) if train is not None else 0,
        "eval_rows": len(eval_ds) if eval_ds is not None else 0,
        "packed_bins": None,
    }
    in_order = bool(cfg.sample_packing_sequentially)
    if cfg.sample_packing and train is not None:
        train = pack_dataset(train, cfg.sequence_len, _worker_processes(cfg), in_order=in_order)
        stats["packed_bins"] = len(train)
    if cfg.eval_sample_packing and eval_ds is not None:
        eval_ds = pack_dataset(eval_ds, cfg.sequence_len, _worker_processes(cfg), in_order=in_order)
    return train, eval_ds, stats


def _hold_out(train: Any, size: float | int, eval_rows: int, cfg: HellbenderConfig) -> tuple[Any, Any]:
    """(training rows, held-out evaluation rows), a random `eval_rows` of them held out. Rows that were not shuffled
    (`shuffle_merged_datasets: false`, as with `curriculum_sampling`) keep their order on both sides."""
    if cfg.shuffle_merged_datasets:
        split = train.train_test_split(test_size=size, seed=cfg.seed, shuffle=True)
        return split["train"], split["test"]
    import numpy as np

    held = np.zeros(len(train), dtype=bool)
    held[np.random.default_rng(cfg.seed).choice(len(train), size=eval_rows, replace=False)] = True
    return train.select(np.flatnonzero(~held)), train.select(np.flatnonzero(held))


# What to change for each reason a row is dropped (see `tokenize` and the vision formats).
DROP_HINTS = {
    "longer than sequence_len": "raise `sequence_len`, or set `excess_length_strategy: truncate`",
    "empty": "check that the text column holds text (`field` / `text_column`, default `text`)",
    "shorter than min_sample_len": "lower `min_sample_len`",
    "duplicate": "set `dataset_exact_deduplication: false` to keep repeated rows",
    DROP_PROMPT_TOO_LONG: "raise `max_prompt_len`, or set `excess_length_strategy: truncate`",
    "no trainable tokens": "check `roles_to_train` (the roles whose turns are trained, default `[assistant]`), "
    "`train_on_inputs`, `train_on_eos` and the messages' `weight` (0 leaves a turn untrained)",
}


def _drop_hints(stats: TokenizeStats) -> str:
    hints = [DROP_HINTS.get(reason) for reason in stats.dropped]
    hints = [h for h in hints if h]
    if any(reason not in DROP_HINTS for reason in stats.dropped):  # image problems dropped by `skip_bad_images`
        hints.append("fix the images, or set `skip_bad_images: false` to see the first bad row and its file")
    return f"To keep rows: {'; '.join(hints)}." if hints else "Check the data and the masking settings."


def _reasons(stats: TokenizeStats) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in stats.dropped.items()) or "no rows"


def prepare_datasets(cfg: HellbenderConfig, tokenizer: Any, processor: Any = None) -> PreparedData:
    """Prepared training / evaluation rows, from the cache when an identical preparation exists.

    `processor` is given for vision-language models; their chat rows keep image paths for batch time."""
    import datasets

    key = cache.cache_key(_cache_parts(cfg, tokenizer, processor))
    root = Path(cfg.dataset_prepared_path)
    found = cache.cached_dir(root, key)
    if found is None:

        def write(staging: Path) -> dict[str, Any]:
            train, eval_ds, stats = _build(cfg, tokenizer, processor)
            for name, part in (("train", train), ("eval", eval_ds)):
                if part is not None:
                    part.save_to_disk(str(staging / name))  # its bar stays: saving large data takes a while
            return {"stats": stats}

        found = cache.write_entry(root, key, write)
        from_cache = False
    else:
        from_cache = True
    meta = json.loads((found / cache.COMPLETE_MARKER).read_text())
    train, eval_ds = (
        datasets.load_from_disk(str(p)) if p.is_dir() else None for p in (found / "train", found / "eval")
    )
    return PreparedData(train=train, eval=eval_ds, stats=meta["stats"], cache_dir=found, from_cache=from_cache)
