"""Issue 25: --ray runs the units as tasks of a Ray cluster; the pair is bit-identical to the serial run.

The cluster is started here on loopback (``ray start --head --num-cpus 2 --block`` in its own process
group, stopped at the end of the module); without Ray (the ``[cluster]`` extra) the cluster tests skip
and say so. The error tests need no cluster.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, make_hf_model, write_hf_dir
from harness.cli import capture_main
from helpers import FAST_CLI, run_cli
from quamba_fixture import write_handmade
from pairs import assert_identical

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as a worker (conftest)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="Ray (the optional [cluster] extra: pip install -e '.[cluster]') is not "
                                      "installed here; the tests that start a local cluster are skipped")
    ray_bin = Path(sys.executable).with_name("ray")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix sockets live under it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
                             "--node-ip-address", "127.0.0.1", "--include-dashboard", "false", "--temp-dir", temp,
                             "--disable-usage-stats"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the head's GCS listens once it is up
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None, head.stderr.read().decode()[-2000:]
            time.sleep(0.5)
    try:
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("ray") / "m3", make_hf_model(d_model=24, n_layer=3, seed=5))


def capture(out_dir: Path, argv: list, *extra) -> tuple[int, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "run.npz"
    return run_cli(capture_main, [*argv, *FAST_CLI, "--no_cache", "--output_file", out, *extra]), out


def test_samples_and_sensitivity_on_ray_with_a_killed_task(cluster, model, tmp_path, monkeypatch):
    """--samples 3 and --sensitivity on the cluster; the task of mode 0's sample 2 is killed on its first
    attempt and submitted again."""
    argv = ["--model", model, "--modes", "fp32", "0", "2-4", "--samples", "3", "--layers", "all", "--sensitivity"]
    rc_serial, serial = capture(tmp_path / "serial", argv)
    monkeypatch.setenv("QUAMBA_HARNESS_FAULT", "unit.0.s2.attempt1:KILL")
    rc, par = capture(tmp_path / "ray", argv, "--ray", cluster)
    assert (rc_serial, rc) == (0, 0)
    assert_identical(serial, par)
    workers = json.loads(par.with_name("run_stats.json").read_text())["provenance"]["workers"]
    assert workers["backend"].startswith("ray (127.0.0.1:") and workers["units"] == 3 * 3 + 2 * 3
    assert [r["unit"] for r in workers["retried"]] == ["0.s2"]


def test_quamba_checkpoint_on_ray(cluster, tmp_path):
    q = write_handmade(tmp_path / "q")
    argv = ["--model", q, "--modes", "0", "2-1", "2-3", "--reference", "0", "--layers", "all", "--taps", "all",
            "--end-to-end"]
    rc_serial, serial = capture(tmp_path / "serial", argv)
    rc, par = capture(tmp_path / "ray", argv, "--ray", cluster)
    assert (rc_serial, rc) == (0, 0)
    assert_identical(serial, par)


def test_unreachable_address_is_exit_2(model, tmp_path, capsys):
    pytest.importorskip("ray", reason="Ray (the [cluster] extra) is not installed: the missing-extra test covers --ray")
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    rc, _ = capture(tmp_path, ["--model", model, "--modes", "fp32"], "--ray", address)
    err = capsys.readouterr().err
    assert rc == 2 and f"--ray {address}: cannot reach the Ray cluster" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_without_ray_the_option_names_the_extra(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as without the extra
    rc, _ = capture(tmp_path, ["--model", model, "--modes", "fp32"], "--ray", "auto")
    err = capsys.readouterr().err
    assert rc == 2 and "pip install -e '.[cluster]'" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_hybrid_on_ray(cluster, tmp_path):
    """The shipped Bamba hybrid (issue 34): its Mamba-2, attention and MLP blocks, Quamba2's W8A8 and the W8A8
    linears with an int8 KV cache, every layer and tap, end to end: the cluster's pair equals the serial one."""
    argv = ["--model", ROOT / "models" / "bamba-tiny", "--modes", "fp32", "q2-w8a8", "q2-w8a8-a8-kv8", "--layers",
            "all", "--taps", "all", "--end-to-end"]
    rc_serial, serial = capture(tmp_path / "serial", argv)
    rc, par = capture(tmp_path / "ray", argv, "--ray", cluster)
    assert (rc_serial, rc) == (0, 0)
    assert_identical(serial, par)
    workers = json.loads(par.with_name("run_stats.json").read_text())["provenance"]["workers"]
    assert workers["backend"].startswith("ray (127.0.0.1:") and workers["units"] == 3  # a unit per mode
