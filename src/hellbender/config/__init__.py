from hellbender.config.loading import dump_config, load_config, validate_config
from hellbender.config.schema import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry

__all__ = [
    "DatasetEntry",
    "HellbenderConfig",
    "PretrainingDatasetEntry",
    "dump_config",
    "load_config",
    "validate_config",
]
