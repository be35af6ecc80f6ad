"""After SIGINT/SIGTERM the command line's one line is the message: multiprocessing's handle-sharing thread,
which reports a worker killed mid-transfer through sys.excepthook (Python 3.11
multiprocessing/resource_sharer.py:133-150), prints no traceback (tests/runner/test_workers.py's SIGTERM test saw one
on a loaded machine)."""
from __future__ import annotations

import signal
import sys

import pytest

from harness.runtime.guard import Interrupted, handle_signals


def _report_like_resource_sharer() -> None:
    try:
        raise EOFError("a worker died while a handle was being sent")
    except EOFError:
        sys.excepthook(*sys.exc_info())


def test_an_interruption_silences_background_tracebacks(capsys, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    _report_like_resource_sharer()
    assert "Traceback" in capsys.readouterr().err       # before: the default hook prints it
    with pytest.raises(Interrupted) as e:
        with handle_signals():
            signal.raise_signal(signal.SIGTERM)
    assert e.value.exit_code == 143
    _report_like_resource_sharer()
    assert capsys.readouterr().err == ""
