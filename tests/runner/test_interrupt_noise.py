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


def test_the_worker_pool_silences_the_handle_sharing_threads_reports(capfd, monkeypatch):
    """A peer dying mid-transfer makes multiprocessing's resource_sharer thread print a traceback through
    sys.excepthook; the pool (runner.workers) prints its own line instead, so that report is dropped, and only
    that one: the main thread's reports still print."""
    import os
    import threading
    import time
    from multiprocessing import current_process, resource_sharer
    from multiprocessing.connection import Client

    from harness.runner.workers import LocalPool

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    LocalPool(1, spill=".")
    fd = os.open(os.devnull, os.O_RDONLY)
    shared = resource_sharer.DupFd(fd)   # starts the sharing thread (a handle a worker would fetch)
    os.close(fd)
    before = threading.active_count()
    with Client(resource_sharer._resource_sharer._address, authkey=current_process().authkey) as c:
        c.send(42)                       # not a (key, pid) request: its _serve fails and reports it
    time.sleep(0.3)
    assert before >= 2 and capfd.readouterr().err == ""
    _report_like_resource_sharer()       # the main thread's report is not the sharer's
    assert "Traceback" in capfd.readouterr().err
    del shared
