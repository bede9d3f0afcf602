"""Tiny vision-language models, one module per family, built in code for the offline examples and tests."""
