"""hellbender: fine-tune and continue pretraining of language and vision-language models from one YAML file."""

__version__ = "0.1.0"
