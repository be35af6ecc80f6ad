"""Fault injection: a real capture run is interrupted at each phase with SIGINT and SIGTERM (and SIGKILL between
the two renames); what is left on disk must be the old pair or the new pair, never a mix, and no temporary file.

The run is a subprocess with QUAMBA_HARNESS_FAULT=<point>:<signal> (harness/guard.py): the process sends itself
the signal when it reaches the point, so each phase is hit deterministically.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, make_hf_model, write_hf_dir
from harness.cli import compare_main
from harness.runtime.guard import OutputLock
from harness.store.reader import load_capture
from harness.store.format import pending_path, stats_path

FAST = ["--seq_len", "16", "--calib_data_num", "4", "--calib_seqlen", "16", "--calib_batch_size", "2"]
PHASES = ["before-calibration", "calibration", "modes", "write-npz", "write-stats", "between-renames"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A one-block model and an old, complete pair (mode fp32 only) to be overwritten by an fp32 + 0 run."""
    base = tmp_path_factory.mktemp("faults")
    model = write_hf_dir(base / "m", make_hf_model(n_layer=1, seed=3))
    old = base / "old"
    old.mkdir()
    r = _capture(model, old, ["fp32"], env={})
    assert r.returncode == 0, r.stderr
    return model, old


def _capture(model, out_dir, modes, env, cache=None, extra=()):
    full_env = {**os.environ, "QUAMBA_HARNESS_CACHE": str(cache or out_dir / "cache"), **env}
    return subprocess.run([sys.executable, str(ROOT / "save_first_layer_io.py"), "--model", str(model), "--modes",
                           *modes, "--output_file", str(out_dir / "out.npz"), "--quiet", *FAST, *extra],
                          capture_output=True, text=True, env=full_env, cwd=out_dir, timeout=300)


def _leftovers(directory):
    """Files other than the pair (temporary files, pending manifests, locks), also in the calibration cache,
    and directories other than the cache (the reference's spill directory)."""
    names = []
    for root, dirs, files in os.walk(directory):
        names += [f for f in files if f not in ("out.npz", "out_stats.json") and not
                  (f.startswith("calib-") and f.endswith(".npz"))]
        names += [d + "/" for d in dirs if d != "cache"]
    return names


@pytest.mark.parametrize("sig", ["INT", "TERM"])
@pytest.mark.parametrize("phase", PHASES)
def test_interrupted_run_leaves_old_or_new_pair_and_no_temporary_file(setup, tmp_path, phase, sig):
    model, old = setup
    for name in ("out.npz", "out_stats.json"):
        shutil.copy(old / name, tmp_path / name)
    before = (tmp_path / "out.npz").read_bytes(), (tmp_path / "out_stats.json").read_bytes()
    r = _capture(model, tmp_path, ["fp32", "0"], env={"QUAMBA_HARNESS_FAULT": f"{phase}:{sig}"})
    signum = getattr(signal, f"SIG{sig}")
    assert r.returncode == 128 + signum, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted by SIG{sig} while "), r.stderr
    assert _leftovers(tmp_path) == []
    cf = load_capture(tmp_path / "out.npz")  # the pair is consistent (sha256 checked)
    if phase == "between-renames":  # signals are deferred across the two renames: the new pair is complete
        assert "were written completely" in last
        assert cf.modes() == ["fp32", "0"] and cf.manifest["modes"]["0"]["status"] == "ok"
    else:
        assert "unchanged (the previous pair)" in last
        assert ((tmp_path / "out.npz").read_bytes(), (tmp_path / "out_stats.json").read_bytes()) == before
        assert cf.modes() == ["fp32"]


def test_sigkill_between_the_renames_is_read_as_the_new_pair(setup, tmp_path):
    """SIGKILL cannot be handled: the pending manifest stays, and readers complete the pair with it."""
    model, old = setup
    for name in ("out.npz", "out_stats.json"):
        shutil.copy(old / name, tmp_path / name)
    r = _capture(model, tmp_path, ["fp32", "0"], env={"QUAMBA_HARNESS_FAULT": "between-renames:KILL"})
    assert r.returncode == -signal.SIGKILL
    out = tmp_path / "out.npz"
    assert pending_path(out).exists()  # the new manifest, not yet renamed
    assert json.loads(stats_path(out).read_text())["modes"].keys() == {"fp32"}  # the old one: a mismatched pair
    cf = load_capture(out)
    assert cf.modes() == ["fp32", "0"] and cf.manifest["npz"]["sha256"] != json.loads(
        stats_path(out).read_text())["npz"]["sha256"]
    assert np.isfinite(cf.array("0", "output")).all()
    lock = OutputLock(out)
    assert lock.path.exists()  # left by the killed run, whose pid is gone: taken over
    lock.acquire()
    lock.release()
    assert not lock.path.exists()
    # the next run (a resume) reads the pending pair, keeps both modes and commits a clean pair
    r = _capture(model, tmp_path, ["1"], env={}, extra=["--resume"])
    assert r.returncode == 0, r.stderr
    assert load_capture(out).modes() == ["fp32", "0", "1"]
    assert compare_main([str(out)]) == 0
    assert not pending_path(out).exists() and _leftovers(tmp_path) == []


def _wait_for_python_handler(p: subprocess.Popen, limit: float = 30.0) -> None:
    """Until the child catches SIGINT (/proc/PID/status SigCgt, bit 2 - 1): before that the interpreter itself is
    still starting, SIGINT is at its default and ends any process with -2 whatever the program does; on a loaded
    machine that start alone took more than a second (the -2 of a cold-cache suite run)."""
    import time

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and p.poll() is None:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p.pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            return
        if (int(fields.get("SigCgt", "0").strip(), 16) >> (signal.SIGINT - 1)) & 1:
            return
        time.sleep(0.005)


@pytest.mark.parametrize("delay", [0.5, 1.0])
@pytest.mark.parametrize("command", [["save_first_layer_io.py"], ["-m", "harness", "export"],
                                     ["-m", "harness", "capture"]], ids=["capture", "export", "python-m-harness"])
def test_ctrl_c_while_starting_shows_no_traceback(tmp_path, command, delay):
    """Every entry imports torch (seconds) before its handlers exist (harness.runtime.startup.begin() covers that time).
    compare_with_fp.py uses the same begin() but imports no torch: it is done in 0.3 s, before any signal.
    Two moments inside the imports: an exception raised there could abort the process (exit -6) when
    it unwound through torch's C++, so the handler leaves with os._exit."""
    import time

    argv = [str(ROOT / command[0]), *command[1:]] if command[0].endswith(".py") else command
    # the child starts with SIGINT at its default, as under a terminal: a suite started in the background by a
    # shell without job control inherits SIGINT ignored, and Python then never installs its handler
    p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_python_handler(p)  # a signal before Python's own start-up installed a handler kills any program
    time.sleep(delay)  # inside the imports (torch alone takes longer)
    if p.poll() is not None:
        pytest.skip("the command ended before the signal")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err and "interrupted by SIGINT while" in err
    assert list(tmp_path.iterdir()) == []
