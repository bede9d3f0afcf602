"""Combinations of keys that a stream cannot honour: `streaming`, `pretraining_dataset`, `max_steps`, and the keys
that shape a stream (`streaming_multipack_buffer_size`, `pretrain_multipack_attn`)."""

from __future__ import annotations

from hellbender.config.schema import HellbenderConfig


def streaming_problems(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []
    stream = (
        "a streamed `pretraining_dataset`" if cfg.streams_pretraining else "a `datasets:` stream (`streaming: true`)"
    )
    if cfg.uses_streaming and cfg.max_steps is None:
        problems.append(
            f"`max_steps` is missing: {stream} has no known length, so the number of steps must be given. Add e.g. "
            "`max_steps: 1000`."
        )
    if cfg.uses_streaming and cfg.val_set_size > 0:
        problems.append(f"`val_set_size` cannot split {stream}; use `test_datasets:` instead.")
    if cfg.streams_pretraining and cfg.datasets:
        problems.append(
            "Mixing `datasets:` with a streamed `pretraining_dataset:` is not supported yet. Train them in separate "
            "runs, or set `streaming: false` to prepare the pretraining text like the other datasets."
        )
    if cfg.streams_pretraining and cfg.sample_packing is False and not cfg.is_multimodal:
        problems.append(
            "`sample_packing: false` cannot be honoured with a streamed `pretraining_dataset`: streamed raw text is "
            "always packed into full `sequence_len` bins (a long document continues in the next bin). Remove the key, "
            "or set `streaming: false` to prepare the text as rows of their own."
        )
    if cfg.streams_datasets and cfg.is_multimodal and all(e.type != "multimodal_pretrain" for e in cfg.datasets):
        problems.append(
            "`streaming: true` streams text `datasets:` rows; image+text chat rows of a vision-language model are "
            "not streamed yet. Set `streaming: false` to prepare them, or stream raw image+text documents under "
            "`pretraining_dataset:` (`type: multimodal_pretrain`)."
        )
    if cfg.streams_datasets and cfg.skip_prepare_dataset:
        problems.append(
            "`streaming: true` and `skip_prepare_dataset: true` are both set: already-tokenized rows are read as "
            "they are, not streamed. Keep one."
        )
    default_buffer = type(cfg).model_fields["streaming_multipack_buffer_size"].default
    if cfg.streaming_multipack_buffer_size != default_buffer:
        buffer = f"`streaming_multipack_buffer_size: {cfg.streaming_multipack_buffer_size}`"
        packs_buffer = cfg.streams_datasets and cfg.sample_packing
        if not cfg.uses_streaming:
            problems.append(
                f"{buffer} sizes the buffers of streamed data, but nothing is streamed here (prepared rows are "
                "shuffled and packed all together). Remove it, or set `streaming: true`."
            )
        elif cfg.shuffle_merged_datasets is False and not packs_buffer:  # None: decided later, on by default
            problems.append(
                f"{buffer} would do nothing: the stream is not shuffled (`shuffle_merged_datasets: false`) and its "
                "rows are not packed from a buffer (that is streamed `datasets:` with `sample_packing: true`). "
                "Remove it, or shuffle the stream."
            )
    if not cfg.pretrain_multipack_attn and not (cfg.streams_pretraining and not cfg.is_multimodal):
        problems.append(
            "`pretrain_multipack_attn: false` lets the documents packed into a bin of streamed `pretraining_dataset` "
            "raw text attend to each other; here there is no such stream ("
            + (
                "streamed image+text rows are not packed"
                if cfg.streams_pretraining
                else "rows of `datasets:` and prepared text always keep their attention to themselves, so that no "
                "row is trained on another row's tokens"
            )
            + "). Remove it."
        )
    return problems
