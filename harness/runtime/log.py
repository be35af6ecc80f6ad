"""The one channel through which library code reports warnings and errors: the ``harness`` logger.

Messages read as the command line has always printed them, ``warning: ...`` and ``error: ...`` on
standard error (the handler looks up sys.stderr at each message, so a redirection or a test's
capture sees them). A program that wants them elsewhere replaces the handler:
``logging.getLogger("harness").handlers[:] = [its own]``, or sets ``propagate = True``.
"""
from __future__ import annotations

import logging
import sys

from .progress import before_message

__all__ = ["logger", "warn", "error"]


class _Stderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            before_message()  # a progress line drawn in place on a terminal is wiped first
            print(f"{record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's contract: a failing handler never raises
            self.handleError(record)


logger = logging.getLogger("harness")
if not any(isinstance(h, _Stderr) for h in logger.handlers):
    logger.addHandler(_Stderr())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def warn(message: str) -> None:
    logger.warning(message)


def error(message: str) -> None:
    logger.error(message)
