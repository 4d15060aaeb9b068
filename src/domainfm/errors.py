"""The error type for wrong input that is not a file's contents: an option out of range, a model
unfit for the command (a headless backbone asked for predictions), an output path of the wrong
kind. The CLI reports it, like the data loaders' errors, as one line with exit status 2; the
Python API raises it like any ``ValueError``.

Data loaders keep their own ``ValueError`` subclasses (they name the file and field); this one is
for the families' apply code and the core.
"""
from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """The user's input is wrong; the message names the file or option and what was expected."""
