"""A teacher's top-k token distributions stored with the rows (offline knowledge distillation, Axolotl's KD row
format), lined up with the student's tokens when data is prepared.

A row holds, besides what its format reads, `target_token_ids` (per position, the teacher's k most likely token ids)
and the `logprobs_field` column (their log-probabilities at the entry's `temperature`); Axolotl's older rows hold only
the `logprobs_field` column, each entry `{"token": "token_id:N", "logprob": x}`. A position may be null or empty (no
target there). The N positions given cover the row's last N tokens: the target at token t is the teacher's
distribution for token t given the tokens before it, which is what the student's logits at t - 1 predict. Prepared
rows hold one (maybe empty) target per token in `target_token_ids` / `target_logprobs`, the log-probabilities
renormalised over the top-k and rescaled to `kd_temperature`, so packing, truncation and batching move them with
their tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hellbender.data.formats.base import RowError

TARGET_IDS = "target_token_ids"
TARGET_LOGPROBS = "target_logprobs"
TARGET_COLUMNS = (TARGET_IDS, TARGET_LOGPROBS)
TARGET_MASK = "target_mask"  # batches only: where a position has a target
LEGACY_TOKEN_PREFIX = "token_id:"
# Part of the prepared-data cache key: a change to how targets are read or stored must not reuse older caches.
TEACHER_TARGETS_VERSION = 1


@dataclass(frozen=True)
class TeacherTargets:
    """How a dataset entry's rows carry the teacher's targets."""

    logprobs_field: str
    temperature: float  # the temperature the stored log-probabilities were taken at
    kd_temperature: float  # the temperature the loss compares distributions at
    vocab: int  # the student tokenizer's size: every target id must be below it


def rescaled(logprobs: list[float], temperature: float, kd_temperature: float) -> list[float]:
    """Log-probabilities taken at `temperature`, renormalised over these k tokens and rescaled to `kd_temperature`:
    p^(temperature / kd_temperature), normalised, i.e. a log-softmax of the scaled log-probabilities."""
    scale = temperature / kd_temperature
    scaled = [value * scale for value in logprobs]
    top = max(scaled)
    log_total = top + math.log(sum(math.exp(value - top) for value in scaled))
    return [value - log_total for value in scaled]


def _legacy_position(entries: list[Any], position: int) -> tuple[list[int], list[float]]:
    ids, logprobs = [], []
    for entry in entries:
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token.startswith(LEGACY_TOKEN_PREFIX) or "logprob" not in entry:
            raise RowError(
                f"position {position} of the teacher's log-probabilities holds {str(entry)[:80]}; Axolotl's older "
                f'rows give each as {{"token": "{LEGACY_TOKEN_PREFIX}N", "logprob": x}}'
            )
        try:
            ids.append(int(token.removeprefix(LEGACY_TOKEN_PREFIX)))
        except ValueError:
            raise RowError(f"position {position}: `{token}` holds no token id") from None
        logprobs.append(entry["logprob"])
    return ids, logprobs


def read_targets(row: dict[str, Any], spec: TeacherTargets) -> tuple[list[list[int]], list[list[float]]]:
    """The row's targets as given: per covered position its token ids and log-probabilities ([] where none)."""
    field = spec.logprobs_field
    logprobs = row.get(field)
    if not isinstance(logprobs, list):
        raise RowError(
            f"column `{field}` (`logprobs_field`) must hold the teacher's top-k log-probabilities per position, a "
            f"list of lists; it is {type(logprobs).__name__ if field in row else 'missing'}"
        )
    first = next((p for p in logprobs if p), None)
    if first is not None and isinstance(first[0], dict):  # Axolotl's older rows: token ids inside the entries
        pairs = [_legacy_position(p or [], i) for i, p in enumerate(logprobs)]
        return [ids for ids, _ in pairs], [lps for _, lps in pairs]
    ids = row.get(TARGET_IDS)
    if not isinstance(ids, list):
        raise RowError(
            f"column `{TARGET_IDS}` must hold the teacher's top-k token ids per position (beside `{field}`); it is "
            f"{type(ids).__name__ if TARGET_IDS in row else 'missing'}"
        )
    if len(ids) != len(logprobs):
        raise RowError(
            f"`{TARGET_IDS}` covers {len(ids)} positions but `{field}` covers {len(logprobs)}; they must match"
        )
    return [list(p or []) for p in ids], [list(p or []) for p in logprobs]


def aligned_targets(
    n_tokens: int, ids: list[list[int]], logprobs: list[list[float]], spec: TeacherTargets
) -> dict[str, list]:
    """One target per token (the given positions cover the last ones), checked and rescaled."""
    covered = len(ids)
    if covered > n_tokens:
        raise RowError(
            f"the teacher's targets cover {covered} positions but the row has {n_tokens} tokens; the targets cover a "
            "row's last positions, one per token at most. The data was written for other tokens (another tokenizer, "
            "chat template or masking): write it again with this config (`hellbender distill-logprobs`)"
        )
    out_ids: list[list[int]] = [[] for _ in range(n_tokens - covered)]
    out_lps: list[list[float]] = [[] for _ in range(n_tokens - covered)]
    for offset, (pos_ids, pos_lps) in enumerate(zip(ids, logprobs, strict=True)):
        position = n_tokens - covered + offset
        if len(pos_ids) != len(pos_lps):
            raise RowError(
                f"token {position}: {len(pos_ids)} target token ids but {len(pos_lps)} log-probabilities; they must "
                "match"
            )
        for token in pos_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < spec.vocab:
                raise RowError(
                    f"token {position}: target token id {token!r} is outside the tokenizer's vocabulary of "
                    f"{spec.vocab}; the teacher must share the student's tokenizer"
                )
        for value in pos_lps:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RowError(f"token {position}: log-probability {value!r} is not a finite number")
        out_ids.append(list(pos_ids))
        out_lps.append(rescaled(pos_lps, spec.temperature, spec.kd_temperature) if pos_lps else [])
    return {TARGET_IDS: out_ids, TARGET_LOGPROBS: out_lps}


def with_teacher_targets(formatter: Callable[..., dict[str, Any]], spec: TeacherTargets) -> Callable[..., Any]:
    """The format's rows with the teacher's targets lined up with their tokens (before any truncation)."""

    def format_row(row: dict[str, Any], ctx: Any) -> dict[str, Any]:
        ids, logprobs = read_targets(row, spec)
        source = {k: v for k, v in row.items() if k not in (spec.logprobs_field, TARGET_IDS)}
        out = formatter(source, ctx)
        return {**out, **aligned_targets(len(out["input_ids"]), ids, logprobs, spec)}

    return format_row


def target_features() -> dict[str, Any]:
    import datasets

    return {
        TARGET_IDS: datasets.List(datasets.List(datasets.Value("int32"))),
        TARGET_LOGPROBS: datasets.List(datasets.List(datasets.Value("float32"))),
    }
