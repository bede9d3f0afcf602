"""`hub_model_id` / `hub_strategy` / `hub_revision`: the values validation accepts, the refusal at the start of a run
that could not push (offline, no token), and what is pushed where and when for each `hub_strategy`, against a local
stand-in for the hub's client passed to the code (no network: the tests run with HF_HUB_OFFLINE=1)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from huggingface_hub.utils import filter_repo_objects

from hellbender.config import validate_config
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.storage import FINAL_MANIFEST, write_manifest
from hellbender.train.hub import LAST_CHECKPOINT, HubPublisher, hub_problem, hub_publisher
from hellbender.train.report import REPORT_DIR, SUMMARY_NAME
from tests.helpers import assert_user_error, base_config, invoke

STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
MODEL_FILES = {"model.safetensors": b"w" * 10, "config.json": b"{}", "tokenizer.json": b"{}"}
RESUME_FILES = {
    "optimizer.pt": b"o",
    "scheduler.pt": b"s",
    "rng_state.pth": b"r",
    "training_args.bin": b"a",
    "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"z",
}


@dataclass
class Upload:
    folder: str  # relative to the output directory
    path_in_repo: str
    files: list[str]  # what upload_folder would send, by its own pattern filter
    repo_id: str
    revision: str | None
    delete_patterns: list[str] | None


class LocalHub:
    """Records what would be created and uploaded; `upload_folder` selects files with huggingface_hub's own filter."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[tuple] = []
        self.uploads: list[Upload] = []

    def create_repo(self, repo_id: str, *, private: bool, exist_ok: bool):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def create_branch(self, repo_id: str, *, branch: str, exist_ok: bool):
        self.calls.append(("create_branch", repo_id, branch, exist_ok))

    def upload_folder(
        self,
        *,
        repo_id,
        folder_path,
        path_in_repo=None,
        revision=None,
        commit_message=None,
        allow_patterns=None,
        ignore_patterns=None,
        delete_patterns=None,
    ):
        folder = Path(folder_path)
        every = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        files = sorted(filter_repo_objects(every, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        relative = folder.relative_to(self.root).as_posix()
        self.uploads.append(Upload(relative, path_in_repo or "", files, repo_id, revision, delete_patterns))
        self.calls.append(("upload_folder", relative, path_in_repo or ""))


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)


def fake_checkpoint(output_dir: Path, step: int) -> Path:
    checkpoint = output_dir / f"checkpoint-{step}"
    write_files(checkpoint, {**MODEL_FILES, **RESUME_FILES, "trainer_state.json": b"{}"})
    write_manifest(checkpoint)
    return checkpoint


def fake_final_model(output_dir: Path) -> None:
    staging = output_dir / ".staging"
    write_files(staging, {**MODEL_FILES, "trainer_state.json": b"{}"})
    write_manifest(staging, FINAL_MANIFEST)
    for path in staging.iterdir():
        path.rename(output_dir / path.name)
    staging.rmdir()
    write_files(output_dir, {"hellbender_config.yml": b"x: 1\n", f"{REPORT_DIR}/{SUMMARY_NAME}": b"report"})


def hub_config(tmp_path: Path, **keys):
    return validate_config(base_config(tmp_path, hub_model_id="me/tiny", **keys))


# ---------------------------------------------------------------------------------------- config values


def test_axolotls_hub_keys_are_accepted_with_transformers_default_strategy(tmp_path):
    cfg = hub_config(tmp_path, hub_revision="runs")
    assert (cfg.hub_model_id, cfg.hub_strategy, cfg.hub_revision) == ("me/tiny", "every_save", "runs")
    for strategy in STRATEGIES:
        assert hub_config(tmp_path, hub_strategy=strategy).hub_strategy == strategy
    plain = validate_config(base_config(tmp_path))
    assert (plain.hub_model_id, plain.hub_strategy, plain.hub_revision) == (None, None, None)


def problems(tmp_path: Path, **keys) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config(base_config(tmp_path, **keys))
    return str(caught.value)


def test_an_unknown_strategy_names_the_key_and_the_choices(tmp_path):
    message = problems(tmp_path, hub_model_id="me/tiny", hub_strategy="always")
    assert "hub_strategy" in message and "always" in message
    for strategy in STRATEGIES:
        assert strategy in message


@pytest.mark.parametrize("repo_id", ["me/tiny/extra", "has space", "a--b", ""])
def test_a_malformed_repository_id_is_refused(tmp_path, repo_id):
    message = problems(tmp_path, hub_model_id=repo_id)
    assert "hub_model_id" in message and "is not a Hugging Face Hub repository id" in message


@pytest.mark.parametrize("key, value", [("hub_strategy", "end"), ("hub_revision", "runs")])
def test_hub_settings_without_a_repository_are_refused(tmp_path, key, value):
    message = problems(tmp_path, **{key: value})
    assert f"`{key}` is set, but `hub_model_id` is not" in message


def test_an_empty_revision_is_refused(tmp_path):
    assert "`hub_revision`" in problems(tmp_path, hub_model_id="me/tiny", hub_revision=" ")


# ---------------------------------------------------------------------------------------- refused at the start


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_is_one_paragraph_naming_the_variable(tmp_path, variable):
    message = hub_problem(hub_config(tmp_path), environ={variable: "1"}, token_lookup=lambda: "hf_token")
    assert message is not None and "\n" not in message
    assert "`hub_model_id: me/tiny`" in message and f"{variable}=1" in message and "hf upload" in message


def test_no_token_is_one_paragraph_saying_how_to_log_in(tmp_path):
    message = hub_problem(hub_config(tmp_path), environ={}, token_lookup=lambda: None)
    assert message is not None and "\n" not in message
    assert "no token is found" in message and "hf auth login" in message and "HF_TOKEN" in message


def test_a_token_and_no_offline_mode_is_no_problem(tmp_path, monkeypatch):
    assert hub_problem(hub_config(tmp_path), environ={"HF_HUB_OFFLINE": "0"}, token_lookup=lambda: "t") is None
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")  # read by huggingface_hub's own get_token
    assert hub_problem(hub_config(tmp_path)) is None


def test_without_hub_model_id_nothing_is_checked(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    assert hub_problem(cfg, environ={"HF_HUB_OFFLINE": "1"}, token_lookup=lambda: None) is None
    assert hub_publisher(cfg) is None


def test_train_refuses_to_start_offline_before_any_work(tmp_path):
    """The command line and the library both stop before preparing data, loading the model or writing anything."""
    cfg = base_config(tmp_path, hub_model_id="me/tiny")
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(cfg))
    result = invoke("train", config, env={"HF_HUB_OFFLINE": "1"})
    assert_user_error(result, "`hub_model_id: me/tiny`", "HF_HUB_OFFLINE=1")
    from hellbender.train.run import train

    with pytest.raises(EnvironmentProblem, match="HF_HUB_OFFLINE=1"):
        train(validate_config(cfg))
    assert not Path(cfg["output_dir"]).exists() and not Path(cfg["dataset_prepared_path"]).exists()


# ---------------------------------------------------------------------------------------- what is pushed, when


def pushes_of_a_run(tmp_path: Path, strategy: str, revision: str | None = None) -> LocalHub:
    """Two checkpoints and the final model, as a run leaves them, pushed as `strategy` says."""
    output_dir = tmp_path / "out"
    hub = LocalHub(tmp_path)
    publisher = HubPublisher("me/tiny", strategy, revision, hub)
    publisher.prepare()
    for step in (2, 4):
        publisher.checkpoint_saved(fake_checkpoint(output_dir, step), step)
    fake_final_model(output_dir)
    publisher.final_model_saved(output_dir, extra_files=["hellbender_config.yml"])
    return hub


MODEL_AT_STEP = sorted([*MODEL_FILES, "trainer_state.json"])
WHOLE_CHECKPOINT = sorted([*MODEL_AT_STEP, *RESUME_FILES, "hellbender_checkpoint.json"])
FINAL = sorted([*MODEL_FILES, "trainer_state.json", FINAL_MANIFEST, "hellbender_config.yml"])
EXPECTED = {
    "end": [("out", "", FINAL)],
    "every_save": [
        ("out/checkpoint-2", "", MODEL_AT_STEP),
        ("out/checkpoint-4", "", MODEL_AT_STEP),
        ("out", "", FINAL),
    ],
    "checkpoint": [
        ("out/checkpoint-2", "", MODEL_AT_STEP),
        ("out/checkpoint-2", LAST_CHECKPOINT, WHOLE_CHECKPOINT),
        ("out/checkpoint-4", "", MODEL_AT_STEP),
        ("out/checkpoint-4", LAST_CHECKPOINT, WHOLE_CHECKPOINT),
        ("out", "", FINAL),
    ],
    "all_checkpoints": [
        ("out/checkpoint-2", "", MODEL_AT_STEP),
        ("out/checkpoint-2", "checkpoint-2", WHOLE_CHECKPOINT),
        ("out/checkpoint-4", "", MODEL_AT_STEP),
        ("out/checkpoint-4", "checkpoint-4", WHOLE_CHECKPOINT),
        ("out", "", FINAL),
    ],
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_pushes_its_folders_in_order(tmp_path, strategy):
    hub = pushes_of_a_run(tmp_path, strategy)
    assert hub.calls[0] == ("create_repo", "me/tiny", True, True)
    assert [(u.folder, u.path_in_repo, u.files) for u in hub.uploads] == EXPECTED[strategy]
    assert {(u.repo_id, u.revision) for u in hub.uploads} == {("me/tiny", None)}
    # `last-checkpoint/` mirrors the newest checkpoint: files of an older one are deleted as it is replaced.
    for upload in hub.uploads:
        assert upload.delete_patterns == (["*"] if upload.path_in_repo == LAST_CHECKPOINT else None)


def test_a_revision_is_created_and_every_upload_goes_to_it(tmp_path):
    hub = pushes_of_a_run(tmp_path, "every_save", revision="runs")
    assert hub.calls[:2] == [("create_repo", "me/tiny", True, True), ("create_branch", "me/tiny", "runs", True)]
    assert {u.revision for u in hub.uploads} == {"runs"}


def test_a_bare_name_pushes_to_the_repository_the_hub_created(tmp_path):
    hub = LocalHub(tmp_path)
    publisher = HubPublisher("tiny", "end", None, hub)
    publisher.prepare()
    fake_final_model(tmp_path / "out")
    publisher.final_model_saved(tmp_path / "out", extra_files=[])
    assert [u.repo_id for u in hub.uploads] == ["me/tiny"]


class UnreachableHub(LocalHub):
    def create_repo(self, repo_id, *, private, exist_ok):
        raise OSError("403 Forbidden: you cannot write to me/tiny")

    def upload_folder(self, **kwargs):
        raise OSError("Connection reset by peer")


def test_a_hub_that_refuses_the_repository_stops_the_run_at_the_start(tmp_path):
    with pytest.raises(EnvironmentProblem, match="403 Forbidden") as caught:
        HubPublisher("me/tiny", "end", None, UnreachableHub(tmp_path)).prepare()
    assert "`hub_model_id: me/tiny`" in str(caught.value)


def test_a_failed_checkpoint_push_lets_training_go_on_and_a_failed_final_push_says_how_to_upload(tmp_path, caplog):
    publisher = HubPublisher("me/tiny", "checkpoint", None, UnreachableHub(tmp_path))
    publisher.checkpoint_saved(fake_checkpoint(tmp_path / "out", 2), 2)  # no exception
    assert "training goes on" in caplog.text
    fake_final_model(tmp_path / "out")
    with pytest.raises(EnvironmentProblem, match="Connection reset") as caught:
        publisher.final_model_saved(tmp_path / "out", extra_files=[])
    assert f"hf upload me/tiny {tmp_path / 'out'}" in str(caught.value)


def test_a_run_pushes_each_checkpoint_once_it_is_complete_then_the_final_model(tmp_path):
    """A real training run (tiny Llama, 4 steps, a checkpoint every 2) with `hub_strategy: checkpoint`."""
    from hellbender.train.run import train

    cfg = validate_config(
        base_config(tmp_path, hub_model_id="me/tiny", hub_strategy="checkpoint", max_steps=4, save_steps=2)
    )
    hub = LocalHub(tmp_path)
    train(cfg, hub_api=hub)
    assert hub.calls[0] == ("create_repo", "me/tiny", True, True)
    assert [(u.folder, u.path_in_repo) for u in hub.uploads] == [
        ("out/checkpoint-2", ""),
        ("out/checkpoint-2", LAST_CHECKPOINT),
        ("out/checkpoint-4", ""),
        ("out/checkpoint-4", LAST_CHECKPOINT),
        ("out", ""),
    ]
    model_at_step, whole_checkpoint, final = (hub.uploads[i].files for i in (0, 1, 4))
    assert "model.safetensors" in model_at_step and "optimizer.pt" not in model_at_step
    # The checkpoint's manifest is in the upload: it was complete (and resumable once downloaded) when pushed.
    assert {"model.safetensors", "optimizer.pt", "hellbender_checkpoint.json"} <= set(whole_checkpoint)
    assert {"model.safetensors", "config.json", FINAL_MANIFEST, "hellbender_config.yml"} <= set(final)
    assert not [f for f in final if f.startswith(("checkpoint-", REPORT_DIR))]
    assert (Path(cfg.output_dir) / REPORT_DIR).is_dir()  # written, and left out of the push
