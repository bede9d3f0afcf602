"""`hellbender train`: from a validated config to a saved model, one step per concern."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig, dump_config
from hellbender.data.prepare import image_policy, prepare_datasets
from hellbender.data.streaming import streaming_dataset
from hellbender.models.adapters import apply_adapter
from hellbender.models.loading import load_model, load_tokenizer_and_processor
from hellbender.train.arguments import training_arguments
from hellbender.train.collator import CausalLMCollator
from hellbender.train.multimodal_collator import MultimodalCollator
from hellbender.train.resume import checkpoint_to_resume
from hellbender.train.schedule import plan_schedule
from hellbender.train.tokens import TokenCounter
from hellbender.train.trainer import HellbenderTrainer

logger = logging.getLogger("hellbender")
RESOLVED_CONFIG_NAME = "hellbender_config.yml"


def train(cfg: HellbenderConfig, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Train as the config says and save the result in `output_dir`; returns the final training metrics.

    `callbacks` are extra transformers `TrainerCallback`s, for programs that drive hellbender as a library.
    """
    from transformers import set_seed

    set_seed(cfg.seed)
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    if cfg.uses_streaming:
        train_data, eval_data, train_rows = streaming_dataset(cfg, tokenizer), None, None
        if cfg.test_datasets:
            eval_data = prepare_datasets(cfg, tokenizer, processor).eval
    else:
        prepared = prepare_datasets(cfg, tokenizer, processor)
        logger.info("Prepared data %s (%s)", prepared.cache_dir, "from cache" if prepared.from_cache else "new")
        train_data, eval_data, train_rows = prepared.train, prepared.eval, len(prepared.train)

    resume_from = checkpoint_to_resume(cfg)  # checked before the model loads, so a bad path fails fast
    model = apply_adapter(cfg, load_model(cfg, tokenizer))
    schedule = plan_schedule(cfg, train_rows)
    args = training_arguments(cfg, schedule, has_eval=eval_data is not None)
    if processor is not None:
        collator = MultimodalCollator(processor, image_policy(cfg))
    else:
        collator = CausalLMCollator(tokenizer.pad_token_id, cfg.attn_implementation)
    trainer = HellbenderTrainer(
        model=model,
        args=args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=collator,
        processing_class=processor or tokenizer,
        callbacks=[TokenCounter(), *(callbacks or [])],
    )
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.output_dir) / RESOLVED_CONFIG_NAME).write_text(dump_config(cfg))
    if resume_from:
        logger.info("Resuming from %s", resume_from)
    result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    trainer.save_model(cfg.output_dir)
    counter = trainer.token_counter()
    trainer.state.stateful_callbacks[type(counter).__name__] = counter.state()
    trainer.save_state()
    metrics = dict(result.metrics)
    metrics.update(input_tokens=counter.input_tokens, trained_tokens=counter.trained_tokens)
    return metrics
