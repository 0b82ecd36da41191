"""The one user-facing error type, in a module of its own so the CLI can catch it without importing torch."""

from __future__ import annotations


class QuantkitError(Exception):
    """A user-facing error: the message says what is wrong and what to do. The CLI exits with 2."""
