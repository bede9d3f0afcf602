"""Distillation with several training processes (DDP over gloo on CPU): offline targets and an online teacher (with
the chunked loss, `kd_fused_loss`) give the same per-step losses, KD and cross-entropy parts included, as one process with the same global batch; the
online teacher is the same model in every process, also as a FSDP2 run loads it; distillation steps with the student
sharded by FSDP2 and a whole teacher in each process equal one process's (tests/kd_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.conftest import write_jsonl
from tests.helpers import base_config, trainer_state
from tests.kd_worker import kd_steps, tiny_student_and_teacher
from tests.test_distillation import kd_config, kd_rows
from tests.test_distributed import run_torchrun

WORKER = Path(__file__).resolve().parent / "kd_worker.py"
PARTS = ("loss", "kd_loss", "ce_loss")


def logged_parts(output_dir: str | Path) -> dict[int, dict[str, float]]:
    return {e["step"]: {k: e[k] for k in PARTS} for e in trainer_state(output_dir)["log_history"] if "loss" in e}


def test_two_processes_distill_like_one_process_with_the_same_global_batch(tmp_path, tiny_tokenizer, tiny_model_path):
    data = write_jsonl(tmp_path / "kd.jsonl", kd_rows(tiny_tokenizer, n=16))
    common = dict(
        adapter="lora", lora_target_linear=True, lora_dropout=0.0, max_steps=3, kd_alpha=0.7, kd_ce_alpha=0.3,
        kd_temperature=2.0,
    )  # fmt: skip

    def offline(name: str, batch: int) -> dict:  # packed rows: each document keeps its own targets
        return kd_config(tmp_path / name, data, micro_batch_size=batch, sample_packing=True, sequence_len=256, **common)

    def online(name: str, batch: int) -> dict:  # the chunked loss and teacher (`kd_fused_loss`)
        return base_config(
            tmp_path / name, kd_trainer=True, kd_teacher_model=str(tiny_model_path), kd_online_topk=8,
            kd_fused_loss=True, micro_batch_size=batch, **common,
        )  # fmt: skip

    singles = [validate_config(offline("offline-1", 4)), validate_config(online("online-1", 4))]
    for cfg in singles:
        train(cfg)
    configs = {"train": [offline("offline-2", 2), online("online-2", 2)], "teacher": online("teacher", 2)}
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    run_torchrun(WORKER, str(tmp_path / "configs.json"), str(tmp_path), OMP_NUM_THREADS="1")
    for cfg, raw in zip(singles, configs["train"], strict=True):
        want, got = logged_parts(cfg.output_dir), logged_parts(raw["output_dir"])
        assert sorted(got) == sorted(want) == [1, 2, 3]
        for step, parts in want.items():
            assert parts["kd_loss"] > 0.01 and parts["ce_loss"] > 0.1  # both parts are real sums
            for key in PARTS:
                assert got[step][key] == pytest.approx(parts[key], abs=1e-4), (cfg.output_dir, step, key, got, want)
    first, second = (torch.load(tmp_path / f"teacher_logits_{rank}.pt") for rank in (0, 1))
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    # FSDP2: the student sharded over both processes, a whole teacher in each, steps like one process
    fsdp2 = json.loads((tmp_path / "fsdp2.json").read_text())
    assert fsdp2["sharded_student_parameters"] > 0 and fsdp2["sharded_teacher_parameters"] == 0
    want = kd_steps(*tiny_student_and_teacher(str(tiny_model_path)))
    assert want[0][0] > 0.01 and want[-1] != want[0]
    for got_parts, want_parts in zip(fsdp2["parts"], want, strict=True):
        assert got_parts == pytest.approx(want_parts, abs=1e-4), (fsdp2["parts"], want)
