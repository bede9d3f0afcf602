"""`hellbender distill-logprobs`: a teacher's top-k log-probabilities for every row of a config's datasets, written
as the rows of offline knowledge distillation (`data/teacher_targets.py`): each row as it was, plus
`target_token_ids` and `logprobs` for its positions from the first trained token to the end. The teacher runs
forward over the rows as the config tokenizes them (no generation).

Each dataset entry's rows go to `<out>/<entry>.jsonl`. Rows are appended to `<entry>.jsonl.partial` as their batch
is done and the file is renamed when complete; `<entry>.json` records what the rows were written from (teacher,
top-k, the entry, its files and the tokenizer). A rerun with the same record skips complete files and continues a
partial one after its last whole row; with another record it starts that entry again."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.config.distillation import KD_DATASET_TYPES, KD_PLUGIN, KD_TUNING_KEYS
from hellbender.data import cache
from hellbender.data.contexts import format_context
from hellbender.data.formats import FORMATTERS, RowDropped, RowError
from hellbender.data.formats.base import IGNORE_INDEX, RowTooLong
from hellbender.data.prepare import row_format
from hellbender.data.sources import load_rows
from hellbender.data.teacher_targets import TARGET_IDS
from hellbender.errors import ConfigError, DataError

logger = logging.getLogger("hellbender")
LOGPROBS_FIELD = "logprobs"
RECORD_VERSION = 1


def teacher_pass_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A config's raw keys with distillation taken out: the teacher pass reads its datasets as plain rows (a
    distillation config that names no targets yet would otherwise be refused for lacking them)."""
    raw = dict(raw)
    for key in ("kd_trainer", *KD_TUNING_KEYS):
        raw.pop(key, None)
    if isinstance(raw.get("plugins"), list):
        raw["plugins"] = [p for p in raw["plugins"] if p != KD_PLUGIN]
    for key in ("datasets", "test_datasets"):
        if isinstance(raw.get(key), list):
            raw[key] = [_plain_entry(e) for e in raw[key]]
    return raw


def _plain_entry(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    entry = {k: v for k, v in entry.items() if k not in ("logprobs_field", "temperature")}
    if entry.get("type") in KD_DATASET_TYPES:
        entry["type"] = "chat_template"
    return entry


def distill_logprobs(
    cfg: HellbenderConfig, teacher: str, top_k: int, out: Path | None = None, batch_size: int = 8
) -> list[tuple[str, Path]]:
    """Write the teacher's targets for every entry of `datasets` and `test_datasets`; returns (entry name, file)."""
    from transformers import AutoModelForCausalLM

    from hellbender.config.precision import torch_dtype
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.train.teacher import check_teacher_tokenizer

    if top_k < 1:
        raise ConfigError(f"`--top-k {top_k}`: give at least 1.")
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    if processor is not None:
        raise ConfigError(
            "`hellbender distill-logprobs` reads text datasets; distillation of vision-language models "
            "(`processor_type`) is not offered yet."
        )
    source = check_teacher_tokenizer(teacher, tokenizer, key="--teacher")
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch_dtype(cfg), attn_implementation=cfg.attn_implementation
    )
    model.eval().requires_grad_(False)
    if torch.cuda.is_available():
        model.to("cuda")
    out = Path(out) if out is not None else Path(cfg.dataset_prepared_path) / "teacher_logprobs"
    out.mkdir(parents=True, exist_ok=True)
    entries = [(f"datasets-{i}", e) for i, e in enumerate(cfg.datasets)]
    entries += [(f"test_datasets-{i}", e) for i, e in enumerate(cfg.test_datasets)]
    written = []
    for name, entry in entries:
        written.append((name, _write_entry(cfg, entry, name, model, tokenizer, teacher, top_k, out, batch_size)))
    return written


def _write_entry(
    cfg: HellbenderConfig,
    entry: DatasetEntry,
    name: str,
    model: Any,
    tokenizer: Any,
    teacher: str,
    top_k: int,
    out: Path,
    batch_size: int,
) -> Path:
    where = f"Dataset {name.replace('-', '[')}] `{entry.path}`"
    final, partial, record_file = out / f"{name}.jsonl", out / f"{name}.jsonl.partial", out / f"{name}.json"
    record = {
        "version": RECORD_VERSION,
        "teacher": teacher,
        "top_k": top_k,
        "entry": entry.model_dump(mode="json"),
        "files": cache.files_fingerprint(entry.path),
        "tokenizer": cache.tokenizer_fingerprint(tokenizer),
        "chat_template": cfg.chat_template,
        "train_on_inputs": cfg.train_on_inputs,
    }
    same = record_file.is_file() and json.loads(record_file.read_text()) == json.loads(json.dumps(record, default=str))
    if same and final.is_file():
        logger.info("%s: %s is complete; kept", where, final)
        return final
    final.unlink(missing_ok=True)
    done = _whole_rows(partial) if same else 0
    if not same:
        partial.unlink(missing_ok=True)
        record_file.write_text(json.dumps(record, default=str, indent=1))
    rows = load_rows(entry, where=where)
    fmt = row_format(entry, rows.column_names, False, where)
    formatter = FORMATTERS[fmt]
    ctx = format_context(entry, cfg, tokenizer, None, where)
    if done:
        logger.info("%s: continuing after row %d of %d", where, done, len(rows))
    with partial.open("a", encoding="utf-8") as f:
        for start in range(done, len(rows), batch_size):
            chunk = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
            encoded = [_encode(row, start + j, formatter, ctx, where) for j, row in enumerate(chunk)]
            for row, targets in zip(chunk, _teacher_targets(model, encoded, tokenizer, top_k), strict=True):
                f.write(json.dumps({**row, **targets}, default=str, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
    partial.rename(final)
    return final


def _whole_rows(partial: Path) -> int:
    """The number of whole rows of a partial file, which is cut after the last of them (a killed write may have
    left half a line)."""
    if not partial.is_file():
        return 0
    data = partial.read_bytes()
    keep = data.rfind(b"\n") + 1
    whole = 0
    for line in data[:keep].splitlines():
        try:
            json.loads(line)
        except ValueError:
            break
        whole += 1
    if whole != data[:keep].count(b"\n") or keep != len(data):
        lines = data[:keep].splitlines(keepends=True)[:whole]
        partial.write_bytes(b"".join(lines))
    return whole


def _encode(row: dict[str, Any], index: int, formatter: Any, ctx: Any, where: str) -> dict[str, list[int]] | None:
    """The row's tokens and labels as training tokenizes it (untruncated: training truncates targets with their
    tokens); None for a row training drops whatever its length."""
    try:
        return formatter(row, ctx)
    except RowError as exc:
        raise DataError(f"{where}, row {index}: {exc}.") from None
    except (RowDropped, RowTooLong):
        return None


def _teacher_targets(
    model: Any, encoded: list[dict[str, list[int]] | None], tokenizer: Any, top_k: int
) -> Iterator[dict[str, list]]:
    """Per row: the teacher's top-k ids and full-vocabulary log-probabilities (temperature 1) at each position from
    the first trained token on; no positions for a row without trained tokens."""
    from hellbender.train.teacher import topk_targets

    spans = []
    for row in encoded:
        labels = row["labels"] if row else []
        first = next((t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX), None)
        spans.append(first)
    todo = [i for i, first in enumerate(spans) if first is not None]
    results: dict[int, dict[str, list]] = {}
    if todo:
        longest = max(len(encoded[i]["input_ids"]) for i in todo)
        device = next(model.parameters()).device
        ids = torch.full((len(todo), longest), tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(todo), longest), dtype=torch.long)
        for j, i in enumerate(todo):
            n = len(encoded[i]["input_ids"])
            ids[j, :n] = torch.as_tensor(encoded[i]["input_ids"])
            mask[j, :n] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[..., : len(tokenizer)]
        # Position t - 1 predicts token t: the target at token t comes from the logits at t - 1.
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        top = topk_targets(logits.float(), top_k, 1.0)
        for j, i in enumerate(todo):
            n, first = len(encoded[i]["input_ids"]), spans[i]
            token_ids = top["target_token_ids"][j, first - 1 : n - 1]
            values = log_probs[j, first - 1 : n - 1].gather(-1, token_ids)
            results[i] = {TARGET_IDS: token_ids.tolist(), LOGPROBS_FIELD: values.tolist()}
    for i in range(len(encoded)):
        yield results.get(i, {TARGET_IDS: [], LOGPROBS_FIELD: []})
