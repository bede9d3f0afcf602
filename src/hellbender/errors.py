"""Errors that are the user's to fix: the CLI prints them as one paragraph and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the config, the data or the machine that the user can act on.

    The message is written for the user: what is wrong, where (key, file, row), and what to do.
    """

    exit_code = 2


class ConfigError(UserError):
    """The YAML config (or a command-line override) is invalid."""


class DataError(UserError):
    """A dataset file or row cannot be used."""


class EnvironmentProblem(UserError):
    """The machine lacks something the config asks for (a GPU, an optional package)."""
