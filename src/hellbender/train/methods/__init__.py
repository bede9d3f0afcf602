"""Preference-tuning methods on TRL's trainers, one small module per method.

Each module exposes one `build_*_trainer` function that takes a model hellbender already built (LoRA applied, or
not), a `transformers.TrainingArguments`, the tokenizer and the prepared, already tokenized datasets, and returns the
TRL trainer. TRL never loads, wraps, quantizes or re-tokenizes anything here.
"""
