"""`use_ray: true`: run `hellbender.train.run.train` in each worker of Ray Train's TorchTrainer.

Ray Train starts the workers, sets torchrun's environment in each (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`) and opens the process group (gloo on CPU, NCCL on GPU) before the training function
runs. The function is the one `hellbender train` and torchrun run: accelerate and the Trainer find that process
group and train with DDP over it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem, UserError
from hellbender.plan.allocator import allocator_environment

logger = logging.getLogger("hellbender")
STORAGE_SUBDIR = "ray"  # Ray Train's run records go inside output_dir, never to ~/ray_results
# dill (which `datasets` uses to fingerprint functions) reads a function's globals from its printed disassembly;
# Ray Train's print-to-log redirection would copy that disassembly into the training log.
PRINT_PATCH_VARIABLE = "RAY_TRAIN_ENABLE_PRINT_PATCH"


def refuse_other_launchers(nproc: int, nnodes: int) -> None:
    """Ray starts the training processes itself; torchrun starting them as well would train copies of the run."""
    flags = [f"`--{name} {n}`" for name, n in (("nproc", nproc), ("nnodes", nnodes)) if n > 1]
    if flags:
        raise ConfigError(
            f"`use_ray: true` and {' and '.join(flags)} both start training processes; pick one launcher. With "
            "Ray, set the number of processes with `ray_num_workers` (and point `RAY_ADDRESS` at a cluster for "
            "several machines); for torchrun, remove `use_ray`."
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "`use_ray: true` was given to a process that torchrun or `accelerate launch` already started "
            f"(WORLD_SIZE={os.environ['WORLD_SIZE']}); pick one launcher: run `hellbender train` once, without "
            "torchrun, to use Ray, or remove `use_ray`."
        )


def train_with_ray(cfg: HellbenderConfig, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Train as `train(cfg, callbacks)` does, in `cfg.ray_num_workers` Ray workers; returns rank 0's training
    metrics. `callbacks` (transformers `TrainerCallback`s) are pickled and run in every worker.

    Uses the Ray cluster this process is connected to, else the one at `RAY_ADDRESS`, else starts a local one
    for this run and stops it afterwards.
    """
    ray, TorchTrainer, ScalingConfig, RunConfig, FailureConfig = _import_ray()
    os.environ.setdefault(PRINT_PATCH_VARIABLE, "0")  # Ray Train passes it on to its workers
    address = os.environ.get("RAY_ADDRESS")
    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=address or "local")
    try:
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        local = connected_here and not address  # started for this run: it will not grow
        _check_capacity(cfg.ray_num_workers, use_gpu, ray.cluster_resources(), local)
        logger.info("Training in %d Ray worker(s) on %s", cfg.ray_num_workers, "GPUs" if use_gpu else "CPUs (gloo)")
        trainer = TorchTrainer(
            _train_in_worker,
            train_loop_config={"config": cfg, "callbacks": callbacks, "cwd": os.getcwd()},
            scaling_config=ScalingConfig(num_workers=cfg.ray_num_workers, use_gpu=use_gpu),
            run_config=RunConfig(
                name=cfg.ray_run_name,
                storage_path=str(Path(cfg.output_dir).resolve() / STORAGE_SUBDIR),
                # A failed worker is reported, not restarted: a user error would only fail again.
                failure_config=FailureConfig(max_failures=0),
                # A cluster's workers do not inherit this process's environment, and Ray Train starts CUDA in
                # each worker before the training function could set the allocator's default: the user's
                # settings, else the default, go with the workers' environment.
                worker_runtime_env={"env_vars": allocator_environment()},
            ),
        )
        try:
            result = trainer.fit()
        except Exception as exc:
            user_error = find_user_error(exc)
            if user_error is None:
                raise
            raise user_error from None
        return dict(result.return_value or {})
    finally:
        if connected_here:
            ray.shutdown()


def _import_ray() -> tuple[Any, ...]:
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        missing = f" (`{exc.name}` is missing)" if exc.name else ""
        raise EnvironmentProblem(
            f"`use_ray: true` needs Ray Train, which is not installed{missing}. Install it with "
            "`pip install 'hellbender[ray]'` (Ray with its `train` extra), or remove `use_ray` to train without Ray "
            "(one process, or `--nproc N` through torchrun)."
        ) from None
    return ray, TorchTrainer, ScalingConfig, RunConfig, FailureConfig


def _check_capacity(workers: int, use_gpu: bool, resources: dict[str, float], local: bool) -> None:
    """Ray Train waits for resources that a cluster may yet gain (autoscaling); a local cluster never will, and
    the run would wait forever."""
    kind = "GPU" if use_gpu else "CPU"  # what Ray Train asks for per worker by default
    available = int(resources.get(kind, 0))
    if workers <= available:
        return
    if local:
        raise ConfigError(
            f"`ray_num_workers: {workers}` asks for {workers} {kind}s (one per worker), but the local Ray cluster "
            f"started for this run has {available}. Lower `ray_num_workers`, or set `RAY_ADDRESS` to a cluster "
            "with enough of them."
        )
    logger.warning(
        "`ray_num_workers: %d` asks for %d %ss; the Ray cluster has %d now. Ray Train waits until it has them.",
        workers,
        workers,
        kind,
        available,
    )


def _train_in_worker(settings: dict[str, Any]) -> dict[str, Any]:
    """One Ray worker's part: the same `train(cfg)` as a torchrun process. Ray hands rank 0's return value (the
    training metrics) to the driver."""
    from hellbender.train.run import train

    # Ray Train starts each worker in a directory of its own; relative paths in the config mean what they meant
    # where `hellbender train` ran (on a machine that has that directory).
    if os.path.isdir(settings["cwd"]):
        os.chdir(settings["cwd"])
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    logging.getLogger("hellbender").setLevel(logging.INFO)
    try:
        return train(settings["config"], settings["callbacks"])
    except UserError as exc:
        # Ray logs a failed worker's traceback; a hellbender error is one paragraph for the user, shown without
        # the trace of where it was found (as the CLI does), then once more, alone, by `hellbender train`.
        raise exc.with_traceback(None) from None


def find_user_error(exc: BaseException) -> UserError | None:
    """The hellbender error behind a failed Ray run, lowest rank first, so the CLI prints its paragraph instead of
    Ray's report. Ray Train keeps each rank's exception in `worker_failures`, wrapped in an exception that holds
    the original in no public attribute (`_base_exc`)."""
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, UserError):
            return current
        failures = getattr(current, "worker_failures", None) or {}
        pending += [failures[rank] for rank in sorted(failures)]
        pending += [getattr(current, "_base_exc", None), current.__cause__, current.__context__]
    return None
