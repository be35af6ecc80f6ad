"""Issue 25: --workers N runs the units in local processes; the pair is bit-identical to the serial run.

Every array and every stats value is compared (tools/snapshot.py's digests), apart from the timing and
worker provenance fields. The faults: a worker killed mid-unit is retried; a unit that always dies is
recorded with the reason, the other modes kept, exit 1; --resume then runs only what is missing.
The local pool's forkserver is started once for the module (the first run pays its torch import).
The serial runs use one torch thread, as each worker does: torch's CPU kernels split some reductions by
thread count, and the sensitivity KLs of a serial run with 2 threads differ from those with 1 in the last
bits (measured on this model), so "bit-identical" is to the serial run with one thread.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, make_hf_model, write_hf_dir
from harness.cli import capture_main
from harness.store.reader import load_capture
from helpers import FAST_CLI, run_cli
from pairs import assert_identical
from quamba_fixture import write_handmade

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("workers") / "m3", make_hf_model(d_model=24, n_layer=3, seed=5))


def capture(out_dir: Path, argv: list, *extra) -> tuple[int, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "run.npz"
    rc = run_cli(capture_main, [*argv, *FAST_CLI, "--no_cache", "--output_file", out, *extra])
    return rc, out


def test_samples_killed_worker_retried_bit_identical(model, tmp_path, monkeypatch, capsys):
    """--samples 3 with --isolated and every tap: mode x sample units; the worker running mode 0's sample 1
    is killed (SIGKILL) on its first attempt and the unit runs again."""
    argv = ["--model", model, "--modes", "fp32", "0", "2-1", "3", "--samples", "3", "--layers", "0", "2",
            "--taps", "all", "--isolated"]
    rc_serial, serial = capture(tmp_path / "serial", argv)
    monkeypatch.setenv("QUAMBA_HARNESS_FAULT", "unit.0.s1.attempt1:KILL")
    rc, par = capture(tmp_path / "par", argv, "--workers", "2")
    assert (rc_serial, rc) == (0, 0)
    assert_identical(serial, par)
    workers = json.loads(par.with_name("run_stats.json").read_text())["provenance"]["workers"]
    assert workers["units"] == 4 * 3 and [r["unit"] for r in workers["retried"]] == ["0.s1"]
    assert "killed by SIGKILL" in workers["retried"][0]["reason"]
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("unit mode")]  # progress: on stderr
    assert len(lines) == 12 and any("mode 0 sample 1" in x and "retry 1" in x for x in lines)
    assert "unit mode" not in captured.out
    died = [x for x in captured.err.splitlines() if "killed by SIGKILL" in x]   # the driver's one line
    assert len(died) == 1 and re.fullmatch(r"warning: worker \d+ killed by SIGKILL while running unit 0\.s1: "
                                           r"running it again", died[0]), died
    assert "Traceback" not in captured.err


def test_sensitivity_bit_identical(model, tmp_path):
    """--sensitivity: mode x sample units, then mode x layer units with the reference's logits shipped."""
    argv = ["--model", model, "--modes", "fp32", "0", "2-4", "--samples", "2", "--layers", "all", "--sensitivity"]
    rc_serial, serial = capture(tmp_path / "serial", argv)
    rc, par = capture(tmp_path / "par", argv, "--workers", "2")
    assert (rc_serial, rc) == (0, 0)
    assert_identical(serial, par)
    stats = json.loads(par.with_name("run_stats.json").read_text())
    assert set(stats["sensitivity"]["0"]) == {"0", "1", "2"} and stats["provenance"]["workers"]["units"] == 3 * 2 + 2 * 3
    assert not list((tmp_path / "par").glob(".quamba-harness-*"))  # the shipped logits are removed


def test_quamba_checkpoint_bit_identical(tmp_path):
    q = write_handmade(tmp_path / "q")
    argv = ["--model", q, "--modes", "0", "2-1", "2-2", "2-3", "--reference", "0", "--layers", "all", "--taps", "all",
            "--end-to-end"]
    rc_serial, serial = capture(tmp_path / "serial", argv)
    rc, par = capture(tmp_path / "par", argv, "--workers", "2")
    assert (rc_serial, rc) == (0, 0)
    assert_identical(serial, par)
    read = json.loads(par.with_name("run_stats.json").read_text())["provenance"]["model"]["tensors_read"]
    assert read["count"] > 0  # the workers' reads are merged into the driver's (equal to the serial run's)


def test_unit_that_always_dies_is_recorded_and_resume_reruns_it(model, tmp_path, monkeypatch, capsys):
    argv = ["--model", model, "--modes", "fp32", "0", "2-4", "--layers", "0", "1", "--taps", "all"]
    _, serial = capture(tmp_path / "serial", argv)
    monkeypatch.setenv("QUAMBA_HARNESS_FAULT", "unit.0.s0:KILL")
    rc, par = capture(tmp_path / "par", argv, "--workers", "2")
    assert rc == 1
    stats = json.loads(par.with_name("run_stats.json").read_text())
    assert stats["failed_modes"] == ["0"] and stats["modes"]["2-4"]["status"] == "ok"
    assert "UnitFailed" in stats["modes"]["0"]["error"] and "killed by SIGKILL" in stats["modes"]["0"]["error"]
    assert "on the retry too" in stats["modes"]["0"]["error"]
    with np.load(serial) as s, np.load(par) as p:  # the other modes are kept, bit for bit
        kept = [k for k in s.files if k.startswith(("mode_fp32_", "mode_2-4_"))]
        assert kept and all(np.array_equal(s[k], p[k]) for k in kept)
        assert not any(k.startswith("mode_0_") for k in p.files)
    capsys.readouterr()
    monkeypatch.delenv("QUAMBA_HARNESS_FAULT")
    rc, par = capture(tmp_path / "par", argv, "--workers", "2", "--resume")
    assert rc == 0
    units = [x for x in capsys.readouterr().err.splitlines() if x.startswith("unit mode")]
    assert len(units) == 1 and units[0].startswith("unit mode 0 sample 0")  # only the missing unit ran
    s, p = load_capture(serial), load_capture(par)  # read through the aliases (dedup follows the mode order)
    assert s.modes() == ["fp32", "0", "2-4"] and sorted(p.modes()) == sorted(s.modes())
    for mode in s.modes():
        assert sorted(s.tensors(mode)) == sorted(p.tensors(mode))
        assert all(np.array_equal(s.array(mode, t), p.array(mode, t)) for t in s.tensors(mode))


def test_sensitivity_unit_that_always_dies(model, tmp_path, monkeypatch):
    argv = ["--model", model, "--modes", "fp32", "0", "--layers", "all", "--sensitivity"]
    _, serial = capture(tmp_path / "serial", argv)
    monkeypatch.setenv("QUAMBA_HARNESS_FAULT", "unit.0.L1:KILL")
    rc, par = capture(tmp_path / "par", argv, "--workers", "2")
    assert rc == 1
    s, p = (json.loads(f.with_name("run_stats.json").read_text()) for f in (serial, par))
    assert [u["unit"] for u in p["failed_units"]] == ["0.L1"] and "killed by SIGKILL" in p["failed_units"][0]["error"]
    assert p["sensitivity"]["0"] == {k: v for k, v in s["sensitivity"]["0"].items() if k != "1"}
    assert p["failed_modes"] == [] and p["comparison"] == s["comparison"]


def test_workers_and_ray_do_not_combine(model, tmp_path, capsys):
    rc, out = capture(tmp_path, ["--model", model, "--modes", "fp32"], "--workers", "2", "--ray", "auto")
    assert rc == 2 and "--workers and --ray do not combine" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        out.update(kids)
        todo += kids
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_on_the_driver_cancels_the_units(model, tmp_path):
    """The driver gets SIGTERM while the sensitivity units run (one worker hangs, SIGSTOPped by the fault
    hook, so the run cannot finish first): exit 143, no file, no temporary directory, no worker left."""
    import os
    import signal
    import subprocess

    env = {**os.environ, "QUAMBA_HARNESS_FAULT": "unit.0.L2:STOP", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "harness", "capture", "--model", str(model), "--modes", "fp32", "0",
                          "--layers", "all", "--sensitivity", "--workers", "2", *FAST_CLI, "--no_cache",
                          "--output_file", str(tmp_path / "out.npz")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    for line in p.stderr:
        if line.startswith("unit mode 0 layer"):
            break
    workers = _descendants(p.pid)
    assert workers  # the forkserver and its workers
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert sorted(x.name for x in tmp_path.iterdir()) == []
    import time

    deadline = time.monotonic() + 20  # the forkserver and the resource tracker see their parent gone and exit
    while any(_running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {w: Path(f"/proc/{w}/cmdline").read_bytes()[:200] for w in workers if _running(w)}
    assert left == {}


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T: stopped, Z), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_close_ends_a_stopped_worker_by_its_sigterm(tmp_path, monkeypatch):
    """close() continues a stopped worker (SIGSTOP: the fault hook here, job control in a terminal), so it exits
    on the SIGTERM; before, it sat stopped through close()'s whole wait (10 s per worker) and was SIGKILLed."""
    import multiprocessing
    import signal
    import time
    from types import SimpleNamespace

    from harness.runner.workers import LocalPool

    def stub(name: str) -> SimpleNamespace:  # what unit_label reads; execute fails after the fault points
        return SimpleNamespace(mode=SimpleNamespace(recipe=SimpleNamespace(name=name)), layer=0)

    monkeypatch.setenv("QUAMBA_HARNESS_FAULT", "unit.hang.L0:STOP")
    pool = LocalPool(2, tmp_path)
    try:
        pool.submit(stub("hang"))
        with pytest.raises(AttributeError):  # the other worker's unit: both units have been handed out
            pool.result(pool.submit(stub("quick")))
        workers = multiprocessing.active_children()
        assert len(workers) == 2
        deadline = time.monotonic() + 60
        while "T" not in [_state(w.pid) for w in workers] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [_state(w.pid) for w in workers].count("T") == 1  # stopped at its fault point; the other is idle
    finally:
        pool.close()
    assert [w.exitcode for w in workers] == [-signal.SIGTERM] * 2
    assert [_state(w.pid) for w in workers] == ["", ""]


def test_sensitivity_stats_do_not_depend_on_the_drivers_thread_count(model, tmp_path):
    """A serial run on 2 torch threads against --workers 2 (one thread per worker): the KLs (torch's full sum
    split its work by thread count) are reduced in one fixed order, so kl and kl_share are the same bits."""
    import torch
    argv = ["--model", model, "--modes", "fp32", "0", "--samples", "2", "--layers", "all", "--sensitivity",
            "--end-to-end"]
    torch.set_num_threads(2)   # the one_thread fixture restores the count afterwards
    rc_serial, serial = capture(tmp_path / "serial", argv)
    torch.set_num_threads(1)
    rc, par = capture(tmp_path / "par", argv, "--workers", "2")
    assert (rc_serial, rc) == (0, 0)
    a, b = (json.loads(p.with_name("run_stats.json").read_text()) for p in (serial, par))
    assert a["sensitivity"] == b["sensitivity"] and set(a["sensitivity"]["0"]) == {"0", "1", "2"}
    assert a["end_to_end"] == b["end_to_end"]


def test_a_normal_close_of_the_workers_prints_nothing(model, tmp_path):
    """save_first_layer_io.py --workers 2: each worker imports the script (as __mp_main__), whose begin() used to
    install the quiet-start handler there, so close()'s SIGTERM printed "interrupted by SIGTERM while starting:
    nothing was written" once per worker after a successful run."""
    out = tmp_path / "run.npz"
    env = {k: v for k, v in __import__("os").environ.items() if k != "QUAMBA_HARNESS_FAULT"}
    env.update(PYTHONPATH=str(ROOT), QUAMBA_HARNESS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "save_first_layer_io.py"), "--model", str(model), "--modes",
                           "fp32", "0", "--samples", "2", *map(str, FAST_CLI), "--no_cache", "--workers", "2",
                           "--output_file", str(out), "--quiet"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "interrupted" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads(out.with_name("run_stats.json").read_text())["provenance"]["workers"]["units"] == 4
