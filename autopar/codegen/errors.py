"""Errors code generation raises for plans or models it cannot turn into code."""
from __future__ import annotations

from autopar.errors import UserError


class CodegenError(UserError):
    """The plan cannot be generated for this model; the message says why and what to change."""
