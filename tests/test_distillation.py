"""Knowledge distillation (`kd_trainer`): the loss is the top-k divergence written out by hand, zero when the student
is the teacher; stored targets stay on their tokens through preparation, truncation and packing; bad rows and a
teacher of another vocabulary are refused by name; online and stored targets of one teacher give the same loss;
`distill-logprobs` continues a stopped pass; a short run learns and its report shows both loss parts."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import validate_config
from hellbender.data.collator import CausalLMCollator
from hellbender.data.prepare import prepare_datasets
from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK, rescaled
from hellbender.errors import ConfigError
from hellbender.models.loading import load_tokenizer
from hellbender.train.distillation_loss import DistillationLoss, distillation_loss
from hellbender.train.teacher import Teacher, per_token, topk_targets
from tests.conftest import write_jsonl
from tests.helpers import CHAT_DATA, assert_user_error, base_config, invoke, trainer_state

VOCAB = 11


# --- the loss, by hand -------------------------------------------------------------------------------------------


def hand_batch():
    """Two rows of 6 tokens; targets per token (token t's target is compared with the logits at t - 1)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, VOCAB, generator=g) * 2
    labels = torch.tensor([[-100, -100, 3, 7, 1, -100], [-100, 5, 5, 9, 2, 0]])
    ids = torch.randint(0, VOCAB, (2, 6, 3), generator=g)
    ids[..., 1] = (ids[..., 0] + 1) % VOCAB  # distinct ids per position
    ids[..., 2] = (ids[..., 0] + 2) % VOCAB
    logprobs = torch.log_softmax(torch.randn(2, 6, 3, generator=g), -1)
    mask = torch.ones(2, 6, 3, dtype=torch.bool)
    mask[1, 3] = False  # a trained token without a target: cross-entropy only
    mask[0, 4, 2] = False  # a position with only two targets
    return logits, labels, ids, logprobs, mask


def by_hand(logits, labels, ids, logprobs, mask, temperature, normalize, beta=0.0):
    """(sum of the divergence, sum of the cross-entropy, trained tokens), position by position with `math`."""
    kd = ce = 0.0
    trained = 0
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[b, t] == -100:
                continue
            trained += 1
            scores = [float(x) for x in logits[b, t - 1]]
            lse = math.log(sum(math.exp(s) for s in scores))
            ce += lse - scores[int(labels[b, t])]
            slots = [k for k in range(ids.shape[-1]) if mask[b, t, k]]
            if not slots:
                continue
            scaled = [s / temperature for s in scores]
            chosen = [scaled[int(ids[b, t, k])] for k in slots]
            norm = math.log(sum(math.exp(s) for s in (chosen if normalize else scaled)))
            log_q = [s - norm for s in chosen]
            log_p = [float(logprobs[b, t, k]) for k in slots]
            if beta == 0.0:
                kd += sum(math.exp(lp) * (lp - lq) for lp, lq in zip(log_p, log_q, strict=True))
            else:
                kd += sum(math.exp(lq) * (lq - lp) for lp, lq in zip(log_p, log_q, strict=True))
    return kd, ce, trained


@pytest.mark.parametrize(
    ("temperature", "normalize", "beta"), [(1.0, False, 0.0), (2.0, False, 0.0), (0.5, True, 0.0), (1.5, False, 1.0)]
)
def test_the_loss_is_the_top_k_divergence_and_cross_entropy_written_out(temperature, normalize, beta):
    logits, labels, ids, logprobs, mask = hand_batch()
    kd, ce, trained = by_hand(logits, labels, ids, logprobs, mask, temperature, normalize, beta)
    settings = DistillationLoss(alpha=0.7, ce_alpha=0.3, temperature=temperature, beta=beta, normalize_topk=normalize)
    alone = distillation_loss(logits, labels, ids, logprobs, mask, settings)  # evaluation: this batch's tokens
    assert trained == 8
    torch.testing.assert_close(alone.kd, torch.tensor(kd / trained))
    torch.testing.assert_close(alone.ce, torch.tensor(ce / trained))
    torch.testing.assert_close(alone.loss, torch.tensor((0.7 * kd + 0.3 * ce) / trained))
    accumulated = distillation_loss(logits, labels, ids, logprobs, mask, settings, num_items_in_batch=torch.tensor(20))
    torch.testing.assert_close(accumulated.loss, torch.tensor((0.7 * kd + 0.3 * ce) / 20))


def test_untrained_positions_and_their_targets_count_nothing():
    logits, labels, ids, logprobs, mask = hand_batch()
    settings = DistillationLoss(alpha=1.0, ce_alpha=1.0)
    before = distillation_loss(logits, labels, ids, logprobs, mask, settings).loss
    changed = logprobs.clone()
    changed[0, :2] = torch.log_softmax(torch.randn(2, 3), -1)  # tokens 0 and 1 of row 0 are not trained
    changed[1, 0] = -5.0  # nor token 0 of row 1
    assert distillation_loss(logits, labels, ids, changed, mask, settings).loss == before


@pytest.mark.parametrize(
    "settings",
    [
        DistillationLoss(ce_alpha=0.5),
        DistillationLoss(ce_alpha=0.5, temperature=2.0, normalize_topk=True),
        DistillationLoss(ce_alpha=0.5, zscore_base_temp=2.0),
        DistillationLoss(ce_alpha=0.5, beta=0.5, normalize_topk=True),
    ],
    ids=["default", "normalized", "zscore", "jensen-shannon"],
)
def test_a_trained_token_without_a_target_gets_the_cross_entropys_gradient_alone(settings):
    """Its softmax over the k would run over nothing: the loss must neither count it nor give any logit a NaN."""
    logits, labels, ids, logprobs, mask = hand_batch()
    student = logits.clone().requires_grad_(True)
    distillation_loss(student, labels, ids, logprobs, mask, settings).loss.backward()
    assert torch.isfinite(student.grad).all()
    trained = int((labels[:, 1:] != -100).sum())
    # Row 1's token 3 has no target; the logits predicting it are at position 2.
    expected = torch.softmax(logits[1, 2], -1) - torch.nn.functional.one_hot(labels[1, 3], VOCAB)
    torch.testing.assert_close(student.grad[1, 2], settings.ce_alpha * expected / trained)


@pytest.mark.parametrize(
    "settings",
    [
        DistillationLoss(temperature=2.0, normalize_topk=True),
        DistillationLoss(zscore_base_temp=2.0),
        DistillationLoss(beta=0.5, normalize_topk=True),
        DistillationLoss(beta=1.0, normalize_topk=True),
    ],
    ids=["normalized", "zscore", "jensen-shannon", "reverse"],
)
def test_the_student_equal_to_the_teacher_gives_zero_divergence_and_gradient(settings):
    logits, labels, *_ = hand_batch()
    targets = per_token(topk_targets(logits, 4, settings.temperature))  # the student's own top 4 as the teacher's
    student = logits.clone().requires_grad_(True)
    parts = distillation_loss(
        student, labels, targets[TARGET_IDS], targets[TARGET_LOGPROBS], targets[TARGET_MASK], settings
    )
    parts.loss.backward()
    assert abs(float(parts.kd)) < 1e-6
    assert student.grad.abs().max() < 1e-6
    # over the whole vocabulary no normalisation is needed
    full = per_token(topk_targets(logits, VOCAB, 1.0))
    whole = distillation_loss(
        logits, labels, full[TARGET_IDS], full[TARGET_LOGPROBS], full[TARGET_MASK], DistillationLoss()
    )
    assert abs(float(whole.kd)) < 1e-6


def test_stored_log_probabilities_are_rescaled_to_the_distillation_temperature():
    given = [-0.2, -1.9, -3.0]  # taken at temperature 1 from a larger vocabulary: they do not sum to 1
    got = rescaled(given, 1.0, 2.0)
    want = torch.log_softmax(torch.tensor(given, dtype=torch.float64) / 2.0, -1).tolist()
    assert got == pytest.approx(want, abs=1e-12)
    assert rescaled(given, 2.0, 2.0) == pytest.approx(
        torch.log_softmax(torch.tensor(given, dtype=torch.float64), -1).tolist(), abs=1e-12
    )


# --- stored targets through preparation --------------------------------------------------------------------------


def kd_rows(tokenizer, n: int = 6) -> list[dict]:
    """Chat rows whose targets cover their last tokens: token t's targets are ids (t, t + 1) with log-probabilities
    (-0.1 x t, -2), so the test can tell where each landed."""
    cfg = validate_config(base_config(Path("/nonexistent")))
    from hellbender.data.contexts import format_context
    from hellbender.data.formats import FORMATTERS

    source = [json.loads(line) for line in Path(CHAT_DATA).read_text().splitlines()[:n]]
    ctx = format_context(cfg.datasets[0], cfg, tokenizer)
    rows = []
    for row in source:
        length = len(FORMATTERS["chat_template"](row, ctx)["input_ids"])
        covered = range(length - 8, length)
        rows.append(
            {
                **row,
                TARGET_IDS: [[t, t + 1] for t in covered],
                "logprobs": [[-0.1 * t, -2.0] for t in covered],
                "length": length,
            }
        )
    return rows


def kd_config(tmp_path: Path, data: Path, **overrides) -> dict:
    entry = {"path": str(data), "type": "axolotl.integrations.kd.chat_template"}
    return base_config(tmp_path, datasets=[entry], plugins=["axolotl.integrations.kd.KDPlugin"], **overrides)


def test_stored_targets_land_on_their_tokens_and_packing_keeps_them_with_their_document(tmp_path, tiny_tokenizer):
    rows = kd_rows(tiny_tokenizer)
    data = write_jsonl(tmp_path / "kd.jsonl", rows)
    plain = prepare_datasets(validate_config(kd_config(tmp_path / "a", data, kd_temperature=2.0)), tiny_tokenizer)
    packed_cfg = kd_config(tmp_path / "b", data, kd_temperature=2.0, sample_packing=True, sequence_len=512)
    packed = prepare_datasets(validate_config(packed_cfg), tiny_tokenizer)
    by_tokens = {}
    for row in plain.train:
        n = len(row["input_ids"])
        assert row[TARGET_IDS][: n - 8] == [[]] * (n - 8)  # before the covered tokens: no target
        for t in range(n - 8, n):
            assert row[TARGET_IDS][t] == [t, t + 1]
            want = torch.log_softmax(torch.tensor([-0.1 * t, -2.0]) / 2.0, -1).tolist()
            assert row[TARGET_LOGPROBS][t] == pytest.approx(want, abs=1e-6)
        by_tokens[tuple(row["input_ids"])] = (row[TARGET_IDS], row[TARGET_LOGPROBS])
    documents = 0
    for row in packed.train:
        start = 0
        for n in row["seq_lens"]:
            doc = tuple(row["input_ids"][start : start + n])
            assert (row[TARGET_IDS][start : start + n], row[TARGET_LOGPROBS][start : start + n]) == by_tokens[doc]
            start, documents = start + n, documents + 1
    assert documents == len(rows) and len(packed.train) < len(rows)
    batch = CausalLMCollator(tiny_tokenizer.pad_token_id)([packed.train[0]])
    t = packed.train[0]["seq_lens"][0] - 1  # the first document's last token
    assert batch[TARGET_IDS][0, t].tolist() == [t, t + 1] and batch[TARGET_MASK][0, t].all()
    assert not batch[TARGET_MASK][0, 0].any()


def test_truncation_cuts_the_targets_with_their_tokens(tmp_path, tiny_tokenizer):
    rows = kd_rows(tiny_tokenizer, n=3)
    data = write_jsonl(tmp_path / "kd.jsonl", rows)
    cfg = kd_config(tmp_path, data, sequence_len=min(r["length"] for r in rows) - 3, excess_length_strategy="truncate")
    prepared = prepare_datasets(validate_config(cfg), tiny_tokenizer)
    for row in prepared.train:
        n = len(row["input_ids"])
        assert len(row[TARGET_IDS]) == n and row[TARGET_IDS][n - 1] == [n - 1, n]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda r: r.update(logprobs=r["logprobs"] * 40, target_token_ids=r[TARGET_IDS] * 40), "cover 320 positions"),
        (
            lambda r: r.update(logprobs=r["logprobs"][:-1]),
            "`target_token_ids` covers 8 positions but `logprobs` covers 7",
        ),
        (lambda r: r[TARGET_IDS][-1].__setitem__(1, 100_000), "target token id 100000 is outside the tokenizer"),
        (lambda r: r["logprobs"][-1].append(-3.0), "2 target token ids but 3 log-probabilities"),
        (lambda r: r.pop(TARGET_IDS), "column `target_token_ids` must hold"),
    ],
    ids=["longer-than-the-row", "ids-and-logprobs-differ", "id-outside-vocabulary", "k-differs", "no-ids"],
)
def test_a_bad_target_row_exits_2_naming_the_row(tmp_path, tiny_tokenizer, change, named):
    rows = kd_rows(tiny_tokenizer, n=3)
    change(rows[2])
    data = write_jsonl(tmp_path / "kd.jsonl", rows)
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(kd_config(tmp_path, data)))
    result = invoke("preprocess", config)
    assert_user_error(result, "row 2", named)
    assert len(result.stderr.strip().split("\n\n")) == 1  # one paragraph


def test_axolotl_older_rows_are_read_too(tmp_path, tiny_tokenizer):
    rows = kd_rows(tiny_tokenizer, n=2)
    older = []
    for row in rows:
        pairs = zip(row.pop(TARGET_IDS), row.pop("logprobs"), strict=True)
        row["logprobs"] = [[{"token": f"token_id:{i}", "logprob": lp} for i, lp in zip(*p, strict=True)] for p in pairs]
        older.append(row)
    data = write_jsonl(tmp_path / "old.jsonl", older)
    cfg = kd_config(tmp_path, data)
    cfg["datasets"][0]["type"] = "axolotl.integrations.kd.chat_template.load_legacy"
    prepared = prepare_datasets(validate_config(cfg), tiny_tokenizer)
    n = len(prepared.train[0]["input_ids"])
    assert prepared.train[0][TARGET_IDS][n - 1] == [n - 1, n]


# --- the config --------------------------------------------------------------------------------------------------


def test_the_plugin_is_accepted_and_the_resolved_config_shows_its_keys(tmp_path):
    cfg = kd_config(tmp_path, Path(CHAT_DATA), kd_alpha=0.9, kd_ce_alpha=0.1, kd_temperature=2.0)
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(cfg))
    result = invoke("validate", config, "--print")
    assert result.exit_code == 0, result.output
    for line in (
        "kd_trainer: true",
        "kd_alpha: 0.9",
        "kd_ce_alpha: 0.1",
        "kd_temperature: 2.0",
        "logprobs_field: logprobs",
    ):
        assert line in result.output


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"kd_alpha": 0.5}, "`kd_alpha` set but knowledge distillation is off"),
        ({"datasets": [{"path": CHAT_DATA, "type": "chat_template", "logprobs_field": "lp"}]}, "only knowledge"),
        ({"kd_trainer": True}, "names no `logprobs_field`"),
        ({"kd_trainer": True, "kd_online_server_base_url": "http://x"}, "`kd_teacher_model`"),
        ({"kd_trainer": True, "kd_teacher_model": "t", "liger_fused_linear_cross_entropy": True}, "fused"),
        ({"kd_trainer": True, "kd_teacher_model": "t", "deepspeed": "deepspeed_configs/zero3.json"}, "with ZeRO-3"),
        (
            {"kd_trainer": True, "kd_online_topk": 8, "datasets": [{"path": CHAT_DATA, "logprobs_field": "l"}]},
            "kd_online_topk",
        ),
    ],
)
def test_distillation_settings_that_cannot_work_are_refused(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=named.replace("`", ".").replace("(", ".")):
        validate_config(base_config(tmp_path, **overrides))


# --- a teacher ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_pass(tmp_path_factory, tiny_model_path):
    """`distill-logprobs` with the tiny Llama as teacher over 24 chat rows, as a user runs it."""
    root = tmp_path_factory.mktemp("teacher")
    data = write_jsonl(root / "chat.jsonl", [json.loads(x) for x in Path(CHAT_DATA).read_text().splitlines()[:24]])
    cfg = base_config(root, datasets=[{"path": str(data), "type": "chat_template"}], kd_trainer=True)
    config = root / "config.yml"
    config.write_text(yaml.safe_dump(cfg))  # a distillation config without targets yet: its kd keys are ignored
    result = invoke("distill-logprobs", config, "--teacher", tiny_model_path, "--top-k", 5, "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root, config, root / "out" / "datasets-0.jsonl"


def test_distill_logprobs_writes_aligned_rows_and_continues_a_stopped_pass(teacher_pass, tiny_model_path):
    root, config, written = teacher_pass
    whole = written.read_bytes()
    rows = [json.loads(line) for line in whole.splitlines()]
    assert len(rows) == 24 and all(len(r[TARGET_IDS]) == len(r["logprobs"]) > 0 for r in rows)
    assert all(len(p) == 5 for r in rows for p in r[TARGET_IDS])
    out = root / "out"
    # A pass killed mid-row: its partial file has 10 whole rows and half of the 11th.
    lines = whole.splitlines(keepends=True)
    written.unlink()
    (out / "datasets-0.jsonl.partial").write_bytes(b"".join(lines[:10]) + lines[10][:40])
    result = invoke("distill-logprobs", config, "--teacher", tiny_model_path, "--top-k", 5, "--out", out)
    assert result.exit_code == 0, result.output
    assert written.read_bytes() == whole and not (out / "datasets-0.jsonl.partial").exists()
    # another top-k is not a continuation of this pass: every row is written again
    (out / "datasets-0.jsonl.partial").write_bytes(b"".join(lines[:10]))
    written.unlink()
    result = invoke("distill-logprobs", config, "--teacher", tiny_model_path, "--top-k", 3, "--out", out)
    assert result.exit_code == 0, result.output
    again = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(again) == 24 and all(len(p) == 3 for r in again for p in r[TARGET_IDS])
    written.write_bytes(whole)  # as the fixture wrote it, for the tests after this one
    (out / "datasets-0.json").write_text((out / "datasets-0.json").read_text().replace('"top_k": 3', '"top_k": 5'))


def test_online_and_stored_targets_of_one_teacher_give_the_same_loss(teacher_pass, tiny_model_path, tmp_path):
    _, _, written = teacher_pass
    tokenizer = load_tokenizer(validate_config(base_config(tmp_path)))
    cfg = validate_config(
        kd_config(tmp_path, written, kd_temperature=2.0, sample_packing=True, kd_ce_alpha=0.5, sequence_len=512)
    )
    prepared = prepare_datasets(cfg, tokenizer)
    batch = CausalLMCollator(tokenizer.pad_token_id)([prepared.train[i] for i in range(2)])
    from transformers import AutoModelForCausalLM

    teacher = Teacher(AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(), 5, 2.0, len(tokenizer))
    online = teacher.targets(batch)
    student = torch.randn(*batch["input_ids"].shape, len(tokenizer), generator=torch.Generator().manual_seed(1))
    settings = DistillationLoss.from_config(cfg)
    stored_loss = distillation_loss(
        student, batch["labels"], batch[TARGET_IDS], batch[TARGET_LOGPROBS], batch[TARGET_MASK], settings
    )
    online_loss = distillation_loss(
        student, batch["labels"], online[TARGET_IDS], online[TARGET_LOGPROBS], online[TARGET_MASK], settings
    )
    torch.testing.assert_close(online_loss.loss, stored_loss.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(online_loss.kd, stored_loss.kd, atol=1e-5, rtol=1e-5)
    assert float(stored_loss.kd) > 0.1  # a real divergence, not two empty sums

    # `hellbender evaluate`'s scores: the config's teacher (online) or the rows' targets (offline) alike
    from hellbender.use.evaluate import token_metrics
    from hellbender.use.evaluate_distillation import DistillationScore

    collate = CausalLMCollator(tokenizer.pad_token_id)
    scores = [
        token_metrics(teacher.model, prepared.train, collate, 1, DistillationScore(settings, t))
        for t in (teacher, None)
    ]
    assert scores[0]["kd_loss"] == pytest.approx(scores[1]["kd_loss"], rel=1e-5) and scores[1]["kd_loss"] > 0.01
    assert scores[0]["ce_loss"] == pytest.approx(scores[1]["loss"], rel=1e-6)


def test_a_teacher_with_another_tokenizer_is_refused_by_name(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_model_path, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<not-the-students>"])
    tokenizer.save_pretrained(other)
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, kd_trainer=True, kd_teacher_model=str(other))))
    assert_user_error(
        invoke("train", config), f"`kd_teacher_model: {other}` uses another tokenizer", "<not-the-students>"
    )
    assert_user_error(
        invoke("distill-logprobs", config, "--teacher", other, "--top-k", 4), "`--teacher", "another tokenizer"
    )


def test_a_short_offline_run_learns_reports_both_parts_and_resumes_exactly(teacher_pass, tmp_path):
    from hellbender.train.run import train
    from tests.helpers import StopAt

    _, _, written = teacher_pass
    common = dict(kd_alpha=0.8, kd_ce_alpha=0.2, sample_packing=True, max_steps=6, save_steps=3, sequence_len=512)
    cfg = validate_config(kd_config(tmp_path / "whole", written, **common))
    train(cfg)
    logs = [e for e in trainer_state(cfg.output_dir)["log_history"] if "loss" in e]
    assert logs[-1]["loss"] < logs[0]["loss"]
    for entry in logs:  # the logged loss is its two parts, weighted
        assert entry["loss"] == pytest.approx(0.8 * entry["kd_loss"] + 0.2 * entry["ce_loss"], abs=2e-4)
    report = Path(cfg.output_dir) / "report"
    assert (report / "distillation_loss.png").stat().st_size > 1000
    assert "- Distillation: KD part" in (report / "report.md").read_text()

    resumed = validate_config(kd_config(tmp_path / "resumed", written, auto_resume_from_checkpoints=True, **common))
    train(resumed, callbacks=[StopAt(3)])
    train(resumed)  # from checkpoint-3, in the middle of the packed bins
    again = [e for e in trainer_state(resumed.output_dir)["log_history"] if "loss" in e]
    assert [e["step"] for e in again] == [e["step"] for e in logs]
    for got, want in zip(again, logs, strict=True):
        for key in ("loss", "kd_loss", "ce_loss"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got, want)


def test_an_online_run_learns_from_a_teacher_that_shares_no_module_with_the_student(
    tmp_path, tiny_model_path, monkeypatch
):
    """`kd_teacher_model` with packed rows: the teacher is its own model in inference mode (its weights end as they
    began, none of its modules or parameters is the student's), and the student learns."""
    from hellbender.train import run as run_module

    seen = {}
    build = run_module._method_trainer

    def recording(*args, **kwargs):
        trainer = build(*args, **kwargs)
        seen["trainer"] = trainer
        return trainer

    cfg = validate_config(
        base_config(
            tmp_path, kd_trainer=True, kd_teacher_model=str(tiny_model_path), kd_online_topk=8, kd_ce_alpha=0.5,
            sample_packing=True, sequence_len=256, max_steps=6,
        )
    )  # fmt: skip
    monkeypatch.setattr(run_module, "_method_trainer", recording)
    run_module.train(cfg)
    trainer = seen["trainer"]
    teacher = trainer.teacher.model
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    student_parts = {id(m) for m in trainer.model.modules()} | {id(p) for p in trainer.model.parameters()}
    assert not student_parts & ({id(m) for m in teacher.modules()} | {id(p) for p in teacher.parameters()})
    from safetensors.torch import load_file

    on_disk = load_file(str(tiny_model_path / "model.safetensors"))
    for name, value in teacher.state_dict().items():
        if name in on_disk:
            torch.testing.assert_close(value, on_disk[name])
    logs = [e for e in trainer_state(cfg.output_dir)["log_history"] if "loss" in e]
    assert logs[-1]["loss"] < logs[0]["loss"] and all("kd_loss" in e for e in logs)


def test_evaluate_scores_both_distillation_parts_as_a_hand_computation_does(tmp_path, tiny_tokenizer):
    """`hellbender evaluate` on an offline distillation config: its KD and cross-entropy parts over the evaluation
    rows (packed, and batched 2 bins at a time, so padded too) equal the loss written out with `math`, document by
    document, each on the trained model's logits of that document alone."""
    from transformers import AutoModelForCausalLM

    rows = kd_rows(tiny_tokenizer, n=7)
    for i, row in enumerate(rows):  # targets the model does not already rank first, two of them per position
        row[TARGET_IDS] = [[(t * 7 + i) % 50 + 3, (t * 11 + 2 * i) % 50 + 60] for t in range(len(row["logprobs"]))]
    data = write_jsonl(tmp_path / "kd.jsonl", rows)
    entry = {"path": str(data), "type": "axolotl.integrations.kd.chat_template"}
    raw = kd_config(
        tmp_path, data, kd_alpha=0.6, kd_ce_alpha=0.4, kd_temperature=2.0, max_steps=2, test_datasets=[entry],
        eval_batch_size=2, sample_packing=True, sequence_len=256,
    )  # fmt: skip
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    assert invoke("train", config).exit_code == 0
    result = invoke("evaluate", config)
    assert result.exit_code == 0, result.output
    scored = json.loads((tmp_path / "out" / "eval_results.json").read_text())

    cfg = validate_config(raw)
    model = AutoModelForCausalLM.from_pretrained(cfg.output_dir).eval()
    kd = ce = 0.0
    tokens = 0
    packed = prepare_datasets(cfg, load_tokenizer(cfg)).eval
    assert len(packed) < 7  # several documents share a bin
    documents = [
        {key: row[key][start : start + n] for key in ("input_ids", "labels", TARGET_IDS, TARGET_LOGPROBS)}
        for row in packed
        for start, n in zip(itertools.accumulate(row["seq_lens"], initial=0), row["seq_lens"], strict=False)
    ]
    assert len(documents) == 7
    for doc in documents:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([doc["input_ids"]])).logits
        k = max(len(p) for p in doc[TARGET_IDS])
        ids = torch.tensor([[p + [0] * (k - len(p)) for p in doc[TARGET_IDS]]])
        logprobs = torch.tensor([[p + [0.0] * (k - len(p)) for p in doc[TARGET_LOGPROBS]]])
        mask = torch.tensor([[[j < len(p) for j in range(k)] for p in doc[TARGET_IDS]]])
        doc_kd, doc_ce, doc_tokens = by_hand(logits, torch.tensor([doc["labels"]]), ids, logprobs, mask, 2.0, False)
        kd, ce, tokens = kd + doc_kd, ce + doc_ce, tokens + doc_tokens
    assert scored["tokens"] == tokens
    assert kd / tokens > 0.05 and ce / tokens > 0.5  # real sums over real targets
    assert scored["kd_loss"] == pytest.approx(kd / tokens, rel=1e-5)
    assert scored["ce_loss"] == pytest.approx(ce / tokens, rel=1e-5)
    assert scored["loss"] == pytest.approx(ce / tokens, rel=1e-5)  # the cross-entropy on the data's own tokens
    assert scored["distillation_loss"] == pytest.approx(0.6 * kd / tokens + 0.4 * ce / tokens, rel=1e-5)


def test_an_online_run_killed_after_a_checkpoint_resumes_in_a_new_process_to_the_same_losses(tmp_path, tiny_model_path):
    """Killed (SIGKILL) in step 3, after checkpoint-2, and started again as a new process: every logged step's
    loss and both its parts equal the uninterrupted run's (packed rows, dropout: the RNG resumes too)."""
    from hellbender.storage import latest_checkpoint
    from hellbender.train.run import train
    from tests.test_fault_injection import crash_run

    def config(root: Path) -> dict:
        return base_config(
            root, kd_trainer=True, kd_teacher_model=str(tiny_model_path), kd_online_topk=8, kd_alpha=0.7,
            kd_ce_alpha=0.3, adapter="lora", lora_target_linear=True, lora_dropout=0.1, sample_packing=True,
            sequence_len=256, micro_batch_size=1, max_steps=4, save_steps=2, auto_resume_from_checkpoints=True,
            memory_watchdog="off",
        )  # fmt: skip

    reference = validate_config(config(tmp_path / "whole"))
    train(reference)
    want = [e for e in trainer_state(reference.output_dir)["log_history"] if "loss" in e]
    run = tmp_path / "killed"
    path = run / "config.yml"
    run.mkdir()
    path.write_text(yaml.safe_dump(config(run)))
    killed = crash_run(path, "--kill-in-step", "3", "--delay-ms", "0")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert latest_checkpoint(run / "out").name == "checkpoint-2"
    resumed = crash_run(path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stderr and "checkpoint-2" in resumed.stderr
    got = [e for e in trainer_state(run / "out")["log_history"] if "loss" in e]
    assert [e["step"] for e in got] == [e["step"] for e in want] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert w["kd_loss"] > 0.01
        for key in ("loss", "kd_loss", "ce_loss"):
            assert g[key] == pytest.approx(w[key], abs=1e-5), (key, g, w)


def test_the_teacher_forward_keeps_no_kv_cache_for_padded_rows(tiny_model_path):
    """Nothing reads the teacher's keys and values: with padded rows (an attention mask, where the model's own
    `use_cache` default would apply) its forward must not keep them for every layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert model.config.use_cache  # the default the forward has to override
    teacher = Teacher(model, 5, 1.0, model.config.vocab_size)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    with torch.no_grad():
        out = teacher._forward({"input_ids": ids, "attention_mask": (ids != 0).long()})
    assert out.past_key_values is None
