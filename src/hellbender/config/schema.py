"""The whole config: one flat model (Axolotl's key layout) assembled from one settings class per concern."""

from __future__ import annotations

from hellbender.config.adapter import AdapterSettings
from hellbender.config.data import DatasetEntry, DataSettings, PretrainingDatasetEntry
from hellbender.config.distillation import KD_PLUGIN, DistillationSettings
from hellbender.config.distributed import DistributedSettings
from hellbender.config.hub import HubSettings
from hellbender.config.kernels import KernelSettings
from hellbender.config.loss import LossSettings
from hellbender.config.model import ModelSettings
from hellbender.config.multimodal import MultimodalSettings
from hellbender.config.plugins import PluginSettings
from hellbender.config.preference import PreferenceSettings
from hellbender.config.quantization import QuantizationSettings
from hellbender.config.rl import RlSettings
from hellbender.config.tracking import TrackingSettings
from hellbender.config.training import TrainingSettings

__all__ = ["HellbenderConfig", "DatasetEntry", "PretrainingDatasetEntry"]


class HellbenderConfig(
    ModelSettings,
    MultimodalSettings,
    AdapterSettings,
    DataSettings,
    TrainingSettings,
    LossSettings,
    DistillationSettings,
    PreferenceSettings,
    RlSettings,
    KernelSettings,
    QuantizationSettings,
    DistributedSettings,
    PluginSettings,
    TrackingSettings,
    HubSettings,
):
    """A validated training config. Build it with `hellbender.config.load_config`, which also checks
    combinations of keys and fills derived defaults."""

    @property
    def streams_pretraining(self) -> bool:
        """`pretraining_dataset` entries are streamed (the default for them)."""
        return bool(self.pretraining_dataset) and self.streaming is not False

    @property
    def streams_datasets(self) -> bool:
        """`streaming: true` with `datasets:` only: supervised rows are streamed."""
        return self.streaming is True and bool(self.datasets) and not self.pretraining_dataset

    @property
    def uses_streaming(self) -> bool:
        """The training rows are streamed (either kind): the run's length comes from `max_steps`."""
        return self.streams_pretraining or self.streams_datasets

    @property
    def distills(self) -> bool:
        """Knowledge distillation is on: `kd_trainer`, or (unset) the KD plugin listed."""
        return self.kd_trainer if self.kd_trainer is not None else KD_PLUGIN in self.plugins

    @property
    def is_multimodal(self) -> bool:
        return self.processor_type is not None

    @property
    def fuses_the_loss(self) -> bool:
        """The model computes its own loss without logits (Liger's fused linear cross-entropy, which Axolotl's
        `cut_cross_entropy` asks for too)."""
        return self.liger_fused_linear_cross_entropy or bool(self.cut_cross_entropy)

    @property
    def checkpoints_activations(self) -> bool:
        """Activation checkpointing is on: `gradient_checkpointing`, or FSDP2's `activation_checkpointing` (both run
        hellbender's own checkpointing)."""
        return bool(self.gradient_checkpointing) or (self.uses_fsdp2 and self.fsdp_settings.activation_checkpointing)

    @property
    def splits_packed_rows(self) -> bool:
        """Context parallelism with packed rows (training or evaluation): the rows are split by hellbender and
        attended with `models/split_attention.py`, which keeps their documents apart, instead of the ring."""
        return self.splits_sequences and (self.sample_packing or self.eval_sample_packing)

    @property
    def compiles_layers(self) -> bool:
        """`torch_compile` with activation checkpointing: hellbender compiles each decoder layer (its checkpoint call
        included); without checkpointing the Trainer compiles the whole model."""
        return self.torch_compile and self.checkpoints_activations

    @property
    def compiles_cuda_graphs(self) -> bool:
        """`torch_compile_mode` records CUDA graphs, whose replays reuse memory (refused with host offloading)."""
        return self.torch_compile and self.torch_compile_mode in ("reduce-overhead", "max-autotune")

    @property
    def sets_layer_counts(self) -> bool:
        """A key whose count must fit the model's decoder layers (`check_layer_counts` in activation_checkpointing)."""
        return self.gradient_checkpointing_layers is not None or bool(self.activation_offload_layers)

    @property
    def report_targets(self) -> list[str]:
        """`report_to` as a list of trackers (`none` is no tracker)."""
        targets = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        return [t for t in targets if t != "none"]

    @property
    def has_eval_data(self) -> bool:
        return bool(self.test_datasets) or self.val_set_size > 0
