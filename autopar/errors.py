"""Errors a user can act on.

Every failure caused by the user's input (model file, overrides, cluster) is raised as a
`UserError` whose message names the problem and the fix; the CLI prints it as one paragraph and
exits 1. Anything else is a bug in autopar and exits 2 with its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, with a message that says how to fix it."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem} Fix: {fix}")


class ModelFileError(UserError):
    """The model.py file breaks the contract (missing, bad syntax, missing function, bad batch)."""


class TraceError(UserError):
    """The model could not be captured as a graph; the message names the module and construct.

    ``data_dependent``: it stopped at a tensor's value, and tracing with the batch's values may pass.
    ``fake_unsupported``: where and why an op could not run on fake tensors (a real build may run it)."""

    data_dependent = False
    fake_unsupported: str | None = None


class ConfigError(UserError):
    """An override or preset is invalid."""
