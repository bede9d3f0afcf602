"""The run report every training run writes into `output_dir/report/`: real PNG plots and a one-page summary, at
each checkpoint save and at the end."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hellbender.config import validate_config
from hellbender.train.memory_watchdog import MemoryWatchdog
from hellbender.train.plots import PLOTS
from hellbender.train.report import REPORT_DIR, SUMMARY_NAME, RunReport
from tests.helpers import base_config


def assert_real_plot(path: Path) -> None:
    """A PNG that decodes, of a sensible size, with a drawing on it (axes, labels, a line): many colours, and far
    from a blank page."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= 400 and image.height >= 200
        pixels = image.convert("RGB")
    colours = pixels.getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 20, f"{path.name} is nearly a single colour"
    white = max(colours)[0]
    assert white < 0.97 * pixels.width * pixels.height, f"{path.name} is almost empty"


@pytest.mark.parametrize("run_name", ["trained_text_lora", "trained_vlm_lora"])
def test_a_finished_run_has_plots_and_a_summary(request, run_name):
    run = request.getfixturevalue(run_name)
    report = run.output_dir / REPORT_DIR
    for name in PLOTS.values():
        assert_real_plot(report / name)
    assert not list(report.glob(".*")), "a temporary file was left behind"
    page = (report / SUMMARY_NAME).read_text()
    steps = run.raw["max_steps"]
    for expected in (
        f"**Finished**: step {steps} of {steps}",
        f"- Base model: `{run.raw['base_model']}`",
        "- Method: LoRA",
        "- Training loss:",
        "- Evaluation loss:",
        "- Wall time:",
        "- Trainable parameters:",
        "| train | 60 |" if "qwen" in run.raw["base_model"] else "| train | 400 | 400 | 0 |",
        f"Used: {(60 if 'qwen' in run.raw['base_model'] else 400) - run.raw['val_set_size']} training rows, "
        f"{run.raw['val_set_size']} evaluation rows.",
        "| eval_loss |",
        "```yaml\n",
        f"\nbase_model: {run.raw['base_model']}\n",  # the resolved config
        *[f"]({name})" for name in PLOTS.values()],
    ):
        assert expected in page, f"{expected!r} not in the report:\n{page}"


def test_each_save_writes_the_report_of_the_run_so_far(trained_text_lora):
    pages = trained_text_lora.reports_at_save
    assert sorted(pages) == [10, 20]
    assert "**In progress**: written when `checkpoint-10` was saved, at step 10 of 20" in pages[10]
    assert "at step 10 (perplexity" in pages[10]  # the evaluation of step 10 is in it
    assert "at step 20 (perplexity" in pages[20]


def test_a_run_resumed_at_its_last_checkpoint_reports_the_finished_run(tmp_path):
    from hellbender.train.run import train

    raw = base_config(tmp_path, adapter="lora", max_steps=2, save_steps=2, memory_watchdog="off")
    train(validate_config(dict(raw)))
    report = Path(raw["output_dir"]) / REPORT_DIR
    shutil.rmtree(report)
    train(validate_config({**raw, "resume_from_checkpoint": f"{raw['output_dir']}/checkpoint-2"}))
    page = (report / SUMMARY_NAME).read_text()
    assert "**Finished**: step 2 of 2" in page and "resumed at step 2" in page
    assert "- Training loss: 6." in page  # the logs of the steps run before the resume
    assert_real_plot(report / PLOTS["loss"])


def fake_state(history: list[dict], step: int, max_steps: int = 100) -> SimpleNamespace:
    return SimpleNamespace(log_history=history, global_step=step, max_steps=max_steps, is_world_process_zero=True)


def train_logs(losses: list[float]) -> list[dict]:
    return [
        {
            "step": i + 1,
            "loss": loss,
            "learning_rate": 1e-3,
            "tokens_per_second": 100.0 + i,
            "input_tokens": 10 * i,
            "trained_tokens": 5 * i,
        }
        for i, loss in enumerate(losses)
    ]


def written_page(tmp_path: Path, report: RunReport, state, moment: str = "end") -> str:
    report.write(tmp_path, state, moment)
    return (tmp_path / REPORT_DIR / SUMMARY_NAME).read_text()


def test_the_page_points_at_what_went_wrong(tmp_path):
    cfg = validate_config(base_config(tmp_path, val_set_size=0.1))
    stats = {
        "train": {
            "rows_in": 100,
            "rows_kept": 90,
            "rows_dropped": {"longer than sequence_len": 10},
            "tokens": 900,
            "trainable_tokens": 300,
        },
        "eval": None,
        "train_rows": 81,
        "eval_rows": 9,
        "packed_bins": None,
    }
    history = train_logs([2.0] * 4 + [2.5] * 4 + [math.nan])
    history += [{"step": s, "eval_loss": v} for s, v in ((2, 2.0), (4, 1.5), (6, 1.9))]
    page = written_page(tmp_path, RunReport(cfg, stats, None), fake_state(history, 9))
    assert "**Stopped** at step 9 of 100" in page
    assert "not finite at step(s) 9" in page
    assert "did not fall" in page
    assert "rose from 1.5 at step 4 to 1.9 at step 6" in page
    assert "10 of 100 training rows (10.0 %) were dropped: 10 longer than sequence_len" in page
    assert "| train | 100 | 90 | 10 | 900 | 300 |" in page
    assert "memory watchdog is off" in page
    assert not (tmp_path / REPORT_DIR / PLOTS["memory"]).exists()
    assert_real_plot(tmp_path / REPORT_DIR / PLOTS["loss"])


def test_plots_are_redrawn_at_a_save_only_when_drawing_stays_a_small_share_of_the_run(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    report = RunReport(cfg, None, None)
    history = train_logs([3.0, 2.5, 2.0, 1.5])
    loss_plot = tmp_path / REPORT_DIR / PLOTS["loss"]
    # A save right at the start: drawing would cost far more than 5 % of the time so far.
    page = written_page(tmp_path, report, fake_state(history[:1], 1), "save")
    assert not loss_plot.exists() and "*loss: no plot, not drawn yet" in page
    report._drawn_at -= 60  # a minute later
    written_page(tmp_path, report, fake_state(history[:2], 2), "save")
    first = loss_plot.read_bytes()
    # Saved again at once: redrawing would cost far more than 5 % of the time since the last drawing.
    page = written_page(tmp_path, report, fake_state(history[:3], 3), "save")
    assert loss_plot.read_bytes() == first
    assert "As of step 2 (redrawn when" in page and "![loss](loss.png)" in page
    page = written_page(tmp_path, report, fake_state(history, 4, 4), "end")  # the end is always drawn
    assert loss_plot.read_bytes() != first and "As of step" not in page


def test_a_report_without_matplotlib_still_has_its_page(tmp_path, monkeypatch):
    import hellbender.train.plots as plots_module

    monkeypatch.setattr(plots_module, "plotting_available", lambda: False)
    cfg = validate_config(base_config(tmp_path))
    watchdog = MemoryWatchdog(samples=[(1, 100 << 20, 200 << 20), (2, 101 << 20, 200 << 20)])
    page = written_page(tmp_path, RunReport(cfg, None, watchdog), fake_state(train_logs([3.0, 2.0]), 2, 2))
    assert "**Finished**: step 2 of 2" in page
    assert page.count("matplotlib is not installed") == len(PLOTS)
    assert "Peak memory: 101 MiB" in page
    assert "streamed (or used as they are)" in page
    assert not list((tmp_path / REPORT_DIR).glob("*.png"))


def test_a_report_that_cannot_be_written_does_not_stop_training(tmp_path, caplog):
    cfg = validate_config(base_config(tmp_path))
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / REPORT_DIR).write_text("a file where the report directory goes")
    RunReport(cfg, None, None).write(blocked, fake_state(train_logs([1.0]), 1), "save")
    assert "run report" in caplog.text and "could not be written" in caplog.text
