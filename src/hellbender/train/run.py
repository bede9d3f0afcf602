"""`hellbender train`: from a validated config to a saved model, one step per concern."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from hellbender.config import HellbenderConfig, dump_config
from hellbender.config.hybrid_sharding import hybrid_shape
from hellbender.config.machine_needs import require_machine
from hellbender.config.precision import torch_dtype
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.data.batching import build_collator
from hellbender.data.prepare import prepare_datasets
from hellbender.data.pretokenized_multimodal import pretokenized_multimodal_rows
from hellbender.data.pretokenized_packing import packed_pretokenized_rows
from hellbender.data.streaming import streaming_dataset
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models.activation_checkpointing import check_layer_counts
from hellbender.models.compile_settings import compile_settings
from hellbender.models.fixes.gemma3n import packed_tail_token_id
from hellbender.models.loading import load_tokenizer_and_processor, model_skeleton
from hellbender.models.packed_attention import documents_need_one_row
from hellbender.models.stack import build_trainable_model
from hellbender.plan.allocator import set_default_allocator_settings
from hellbender.storage import (
    WRITE_ERRNOS,
    complete_checkpoints,
    make_directory,
    write_errno,
    write_file_atomically,
)
from hellbender.train.arguments import training_arguments
from hellbender.train.deepspeed import deepspeed_before_loading
from hellbender.train.distributed import is_main_process, main_process_first, world_size
from hellbender.train.divergence import Divergence
from hellbender.train.eaft import eaft_loss_function
from hellbender.train.fsdp import (
    announce_host_offload,
    check_fsdp_processes,
    check_wrap_classes,
    context_parallel_groups,
    prepare_quantized_for_fsdp,
    shard_norms_in_fp32,
)
from hellbender.train.hub import HubApi, HubPush, hub_publisher
from hellbender.train.loss_watchdog import DIVERGED_EXIT_CODE, LossWatchdog
from hellbender.train.lr_schedule import own_lr_factor
from hellbender.train.memory_watchdog import MemoryWatchdog
from hellbender.train.methods import preference_method
from hellbender.train.out_of_memory import out_of_memory_error
from hellbender.train.preemption import StopOnSignal
from hellbender.train.report import RunReport
from hellbender.train.resume import (
    CheckpointKeeper,
    SaveFirstStep,
    StopIfAlreadyDone,
    TrainingAlreadyDone,
    checkpoint_to_resume,
    remove_incomplete_checkpoints,
    resume_key,
    verify_contents,
)
from hellbender.train.run_identity import claim_output_dir, record_owner
from hellbender.train.schedule import plan_schedule
from hellbender.train.tokens import StreamPosition, TokenCounter
from hellbender.train.trainer import HellbenderMixin, HellbenderTrainer
from hellbender.train.unused_weights import UnusedWeightsNotice

logger = logging.getLogger("hellbender")
RESOLVED_CONFIG_NAME = "hellbender_config.yml"


def train(cfg: HellbenderConfig, callbacks: list[Any] | None = None, hub_api: HubApi | None = None) -> dict[str, Any]:
    """Train as the config says and save the result in `output_dir`; returns the final training metrics.

    `callbacks` are extra transformers `TrainerCallback`s, for programs that drive hellbender as a library.
    `hub_api` stands in for the Hugging Face Hub's client where `hub_model_id` pushes (tests, mirrors).
    """
    from transformers import EarlyStoppingCallback, set_seed

    set_default_allocator_settings()  # expandable segments, unless the user set the allocator or CUDA has started
    require_machine(cfg)  # a GPU or package the config needs: before anything is written
    if cfg.gpu_memory_limit is not None:  # the planned peak against the limit, before any data or weights
        from hellbender.plan.budget import refuse_what_does_not_fit

        refuse_what_does_not_fit(cfg, world_size())
    set_seed(cfg.seed)
    announce_host_offload(cfg)  # before anything opens the process group
    if not is_main_process():  # one process reports; the others speak only of problems
        logger.setLevel(logging.WARNING)
    resume_from = checkpoint_to_resume(cfg)  # checked first, so a bad path fails before any work
    run = None
    if is_main_process():  # before anything in `output_dir` is touched: it must hold no other run's outputs
        if resume_from is not None:
            verify_contents(resume_from, resume_key(cfg))
        run = claim_output_dir(cfg, resume_from, resume_key(cfg))
    publisher = hub_publisher(cfg, hub_api)  # offline or without a token: stops here, not after training
    if publisher is not None and is_main_process():
        publisher.prepare()
    if cfg.tiled_mlp and world_size() > 1:
        raise ConfigError(
            f"`tiled_mlp` runs in one training process only, and this run has {world_size()}: its MLP shards "
            "back-propagate inside the layer's backward, which DDP's gradient hooks do not expect. Train on one GPU, "
            "or remove `tiled_mlp`."
        )
    with main_process_first():  # the main process tidies, builds and caches; the others then read its results
        if is_main_process():
            remove_incomplete_checkpoints(cfg.output_dir)  # a killed save's leftovers; never trusted, written again
        tokenizer, processor = load_tokenizer_and_processor(cfg)
        if cfg.distills and cfg.kd_teacher_model:  # a teacher of another vocabulary is refused before the data work
            from hellbender.train.teacher import check_teacher_tokenizer

            check_teacher_tokenizer(cfg.kd_teacher_model, tokenizer)
        if cfg.uses_fsdp2 or cfg.sets_layer_counts:
            # Checked on the model's structure before the data work; they would otherwise fail only after it.
            skeleton = model_skeleton(cfg)
            if cfg.uses_fsdp2:
                check_wrap_classes(cfg, skeleton)
                check_fsdp_processes()
                hybrid_shape(cfg, world_size() // context_parallel_groups(cfg, world_size()))
            check_layer_counts(cfg, skeleton)
        # Streamed image+text rows resume at the next unseen row (no image of a trained row is opened again), so
        # the Trainer must not replay the stream to skip batches itself (whatever `ignore_data_skip` says).
        streams_images = cfg.streams_pretraining and processor is not None
        train_data, eval_data, data_stats = _training_data(cfg, tokenizer, processor, resume_from, streams_images)
    _deepspeed_at_load = deepspeed_before_loading(cfg)  # ZeRO-3 partitions weights as they load; kept alive
    model = build_trainable_model(cfg, tokenizer)
    if cfg.uses_fsdp2 and cfg.load_in_4bit:
        logger.info("FSDP2 shards %d 4-bit weights", prepare_quantized_for_fsdp(cfg, model))
    if cfg.fp32_norms:  # their own FSDP2 groups, before accelerate shards the decoder layers around them
        sharded = shard_norms_in_fp32(model, cfg.fp32_norm_classes, torch_dtype(cfg))
        logger.info("fp32_norms: %d norm modules kept in float32", sharded)
    train_rows = len(train_data) if not cfg.uses_streaming else None
    if cfg.rl in ONLINE_RL_METHODS and cfg.trl is not None and train_rows is not None:
        train_rows *= cfg.trl.num_generations  # each prompt is trained as that many generated completions
    schedule = plan_schedule(cfg, train_rows, world_size())
    args = training_arguments(cfg, schedule, eval_data is not None, streams_images, *_method_arguments(cfg))
    stop_on_signal = StopOnSignal()
    loss_watchdog = (
        LossWatchdog(cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience) if cfg.loss_watchdog_threshold else None
    )
    watchdog = MemoryWatchdog(cfg.memory_watchdog) if cfg.memory_watchdog != "off" else None
    divergence = Divergence()
    trainer = _method_trainer(
        cfg,
        model,
        args,
        train_data,
        eval_data,
        tokenizer,
        processor,
        lr_factor=own_lr_factor(cfg, schedule),
        run=run,
        divergence=divergence,
        callbacks=[
            TokenCounter(),
            UnusedWeightsNotice(),
            *([StreamPosition()] if streams_images else []),
            *([watchdog] if watchdog else []),
            *([SaveFirstStep()] if cfg.save_first_step else []),
            *_qat_callbacks(cfg),
            *([EarlyStoppingCallback(cfg.early_stopping_patience)] if cfg.early_stopping_patience else []),
            CheckpointKeeper(cfg.save_total_limit, run),
            RunReport(
                cfg, data_stats, watchdog, divergence
            ),  # after the keeper: a checkpoint is complete before its report
            *([HubPush(publisher)] if publisher else []),  # likewise before it is pushed
            stop_on_signal,
            *([loss_watchdog] if loss_watchdog else []),
            *([StopIfAlreadyDone()] if resume_from else []),
            *(callbacks or []),
        ],
    )
    make_directory(Path(cfg.output_dir))
    if is_main_process():
        record_owner(Path(cfg.output_dir), run)
        write_file_atomically(Path(cfg.output_dir) / RESOLVED_CONFIG_NAME, dump_config(cfg))
    if resume_from:
        logger.info("Resuming from %s", resume_from)
        if streams_images:
            trainer.restore_rng_before_first_step(resume_from)
    try:
        with compile_settings(cfg):
            metrics = dict(trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None).metrics)
    except TrainingAlreadyDone:
        logger.info("%s is the last step: saving the final model", resume_from)
        metrics = {}
    except torch.OutOfMemoryError:
        raise out_of_memory_error(cfg, trainer.state.global_step + 1) from None
    except pickle.UnpicklingError as exc:  # the Trainer loads checkpoint states with `weights_only=True`
        raise ConfigError(
            f"Resuming from {resume_from} failed: one of its files holds Python objects that a weights-only load "
            f"refuses ({_unpickling_reason(exc)}). hellbender never unpickles arbitrary objects, "
            "which could run code. Resume from a checkpoint you wrote yourself, or remove this one."
        ) from None
    except OSError as exc:
        raise _write_failure(exc, cfg, f"Training stopped at step {trainer.state.global_step}") or exc from None
    except RuntimeError as exc:
        if resume_from is None or "size mismatch" not in str(exc):
            raise
        raise ConfigError(
            f"Resuming from {resume_from} failed: its weights do not fit the model this config builds "
            f"({str(exc).splitlines()[-1].strip()[:200]}). It belongs to a run with another base model or adapter "
            "shape (`lora_r`, `lora_target_modules`, ...): resume it with the config it was trained with, or start a "
            "new run with another `output_dir`."
        ) from None
    counter = trainer.token_counter()
    metrics.update(input_tokens=counter.input_tokens, trained_tokens=counter.trained_tokens)
    if stop_on_signal.received is not None:
        logger.warning(
            "Stopped by %s after step %s; checkpoint-%s is saved. %s",
            stop_on_signal.received.name,
            stop_on_signal.stopped_at_step,
            stop_on_signal.stopped_at_step,
            "It holds the model only (`save_only_model`), so a run cannot resume from it."
            if cfg.save_only_model
            else "Run again with `auto_resume_from_checkpoints: true` to continue.",
        )
        metrics["exit_code"] = stop_on_signal.exit_code
        return metrics
    if divergence.step is not None:
        logger.error(divergence.message())
        metrics["exit_code"] = DIVERGED_EXIT_CODE
        return metrics
    if loss_watchdog is not None and loss_watchdog.stopped_at_step is not None:
        logger.error(loss_watchdog.message())
        metrics["exit_code"] = DIVERGED_EXIT_CODE
        return metrics
    try:
        trainer.save_final_model(cfg.output_dir)
    except OSError as exc:
        raise _write_failure(exc, cfg, "Saving the final model failed after training") or exc from None
    if publisher is not None and is_main_process():
        publisher.final_model_saved(Path(cfg.output_dir), extra_files=[RESOLVED_CONFIG_NAME])
    return metrics


def _qat_callbacks(cfg: HellbenderConfig) -> list[Any]:
    if cfg.qat is None or cfg.qat.fake_quant_after_n_steps is None:
        return []
    from hellbender.train.qat import FakeQuantAfterSteps

    return [FakeQuantAfterSteps(cfg.qat.fake_quant_after_n_steps)]


def _method_arguments(cfg: HellbenderConfig) -> tuple[type, dict[str, Any] | None]:
    """The TrainingArguments class the method's trainer reads, and the settings only that method has."""
    method = preference_method(cfg)
    if method is not None:
        return method.arguments(cfg)
    from transformers import TrainingArguments

    return TrainingArguments, None


def _method_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: Any,
    train_data: Any,
    eval_data: Any,
    tokenizer: Any,
    processor: Any,
    **hellbender: Any,
) -> HellbenderMixin:
    """The trainer of the config's training method: preference tuning with `rl` or a reward model with
    `reward_model` (train/methods/), else supervised fine-tuning (or continued pretraining). `hellbender`: the
    keywords every hellbender trainer takes (`HellbenderMixin`'s and the callbacks)."""
    method = preference_method(cfg)
    if method is not None:
        from hellbender.data.preference_collator import preference_collator

        collator = preference_collator(cfg, tokenizer, processor)  # pairs with images (DPO, IPO); None: TRL's own
        extra = {"data_collator": collator} if collator is not None else {}
        return method.build_trainer(
            cfg, model, args, train_data, eval_data, processor or tokenizer, **extra, **hellbender
        )
    if cfg.distills:
        from hellbender.train.distillation import DistillationTrainer, fused_distillation
        from hellbender.train.distillation_loss import DistillationLoss
        from hellbender.train.teacher import load_teacher

        fused = fused_distillation(cfg)
        return DistillationTrainer(
            distillation=DistillationLoss.from_config(cfg),
            teacher=load_teacher(cfg, tokenizer, chunked=fused) if cfg.kd_teacher_model else None,
            fused=fused,
            fused_required=cfg.kd_fused_loss is True,
            model=model,
            args=args,
            train_dataset=train_data,
            eval_dataset=eval_data,
            data_collator=_collator(cfg, model, tokenizer, processor),
            processing_class=tokenizer,
            **hellbender,
        )
    return HellbenderTrainer(
        fused_loss=cfg.fuses_the_loss,
        **({"compute_loss_func": eaft_loss_function(cfg.eaft_alpha, cfg.eaft_k)} if cfg.use_eaft else {}),
        model=model,
        args=args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=_collator(cfg, model, tokenizer, processor),
        processing_class=processor or tokenizer,
        **hellbender,
    )


def _collator(cfg: HellbenderConfig, model: Any, tokenizer: Any, processor: Any) -> Any:
    return build_collator(
        cfg,
        tokenizer,
        processor,
        packed_tail_token_id(model, tokenizer),
        one_row_per_batch=documents_need_one_row(model),
    )


def _training_data(
    cfg: HellbenderConfig, tokenizer: Any, processor: Any, resume_from: Path | None, streams_images: bool
):
    """(training data, evaluation data or None, the prepared data's statistics or None) for the routes: online RL's
    prompt rows, streamed, used as is, prepared."""
    if cfg.rl in ONLINE_RL_METHODS:
        from hellbender.data.grpo_rows import grpo_split

        train_rows, eval_rows = grpo_split(cfg, tokenizer)
        return train_rows, eval_rows, None
    if cfg.uses_streaming or cfg.skip_prepare_dataset:
        # Only evaluation data is prepared; `prepare_datasets` leaves these training rows alone.
        prepared_eval = prepare_datasets(cfg, tokenizer, processor) if cfg.test_datasets else None
        eval_data, stats = (prepared_eval.eval, prepared_eval.stats) if prepared_eval else (None, None)
        if cfg.skip_prepare_dataset:
            rows = pretokenized_multimodal_rows(cfg)
            if cfg.sample_packing:
                rows = packed_pretokenized_rows(cfg, rows, tokenizer, processor)
            return rows, eval_data, stats
        start_row = _stream_rows_consumed(resume_from) if streams_images else 0
        return streaming_dataset(cfg, tokenizer, processor, start_row), eval_data, stats
    prepared = prepare_datasets(cfg, tokenizer, processor)
    logger.info("Prepared data %s (%s)", prepared.cache_dir, "from cache" if prepared.from_cache else "new")
    return prepared.train, prepared.eval, prepared.stats


def _write_failure(exc: OSError, cfg: HellbenderConfig, what_stopped: str) -> EnvironmentProblem | None:
    """A checkpoint, log or report that the machine would not let training write (disk full, quota, read-only,
    permissions), as one paragraph; None for other OS errors. The checkpoint being written has no manifest yet, so no
    later run trusts it (the next start removes it); the newest complete one is named."""
    code = write_errno(exc)
    if code is None:
        return None
    complete = complete_checkpoints(cfg.output_dir)
    kept = (
        f"`{complete[-1].name}` is the newest complete checkpoint; run again with `auto_resume_from_checkpoints: "
        "true` to continue from it"
        if complete
        else "no checkpoint was complete yet, so a new run starts from the beginning"
    )
    where = f"`{exc.filename}`" if exc.filename else f"into `{cfg.output_dir}`"
    return EnvironmentProblem(
        f"{what_stopped}: could not write {where}: {os.strerror(code)}. "
        f"What was being written is not trusted by any later run (it is removed at the next start); {kept}. To go "
        f"on, {WRITE_ERRNOS[code]}."
    )


def _stream_rows_consumed(checkpoint: Path | None) -> int:
    if checkpoint is None:
        return 0
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    stored = state.get("stateful_callbacks", {}).get(StreamPosition.__name__, {})
    return int(stored.get("attributes", {}).get("rows_consumed", 0))


def _unpickling_reason(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = [line for line in lines if "WeightsUnpickler error" in line]
    return (detail or lines or [type(exc).__name__])[0].split(". Please use")[0]
