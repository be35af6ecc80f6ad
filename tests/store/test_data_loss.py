"""Nothing a user has on disk is lost, and bad numbers are never a pass (docs/guarantees.md)."""
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from helpers import edit_cache_entry
from harness.cli import capture_main, compare_main
from harness.store.format import StorageError, stats_path, write_pair
from harness.store.reader import load_capture

FAST = ["--seq_len", "16", "--calib_data_num", "4", "--calib_seqlen", "16", "--calib_batch_size", "2"]


def _cli(main, argv, capsys):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _capture(model, out, modes, capsys, *extra):
    return _cli(capture_main, ["--model", model, "--modes", *modes, "--output_file", out,
                               "--cache_dir", out.parent / "cache", *FAST, *extra], capsys)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("dl") / "m", make_hf_model(n_layer=1, seed=5))


def test_resume_keeps_every_mode_and_reruns_only_when_asked(model, tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert _capture(model, out, ["fp32", "0"], capsys)[0] == 0
    before = load_capture(out)
    kept = {m: np.array(before.array(m, "output")) for m in ("fp32", "0")}
    rc, stdout, _ = _capture(model, out, ["2-1"], capsys, "--resume")  # today this deleted fp32 and 0
    assert rc == 0
    cf = load_capture(out)
    assert cf.modes() == ["fp32", "0", "2-1"]
    assert all(np.array_equal(cf.array(m, "output"), kept[m]) for m in kept)
    assert cf.manifest["modes"]["0"]["resumed"] and "resumed" not in cf.manifest["modes"]["2-1"]
    assert "mode 0: kept from" in stdout and cf.manifest["comparison"]["modes"]["2-1"]["output"]["mse"] > 0
    rc, stdout, _ = _capture(model, out, ["0"], capsys, "--resume", "--rerun", "0")
    assert rc == 0 and "mode 0: kept" not in stdout
    cf = load_capture(out)
    assert cf.modes() == ["fp32", "0", "2-1"] and "resumed" not in cf.manifest["modes"]["0"]
    assert cf.manifest["modes"]["fp32"]["resumed"]


def test_resume_reruns_a_mode_whose_arrays_are_incomplete(model, tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert _capture(model, out, ["fp32", "0"], capsys, "--no-dedup")[0] == 0
    cf = load_capture(out)
    arrays = {k: np.array(cf.npz[k]) for k in cf.npz.files if k != "mode_0_residual"}
    stats = {k: v for k, v in cf.manifest.items() if k != "npz"}
    write_pair(out, arrays, stats)  # a consistent pair whose mode 0 lacks an array
    rc, stdout, err = _capture(model, out, ["fp32"], capsys, "--resume")
    assert rc == 0 and "mode 0 in" in err and "incomplete arrays (residual)" in err
    cf = load_capture(out)
    assert cf.modes() == ["fp32", "0"] and "resumed" not in cf.manifest["modes"]["0"]
    assert cf.manifest["modes"]["fp32"]["resumed"] and cf.array("0", "residual").shape == (1, 16, 24)


def _disk_full_for_mode(monkeypatch, mode):
    """Writing any array of `mode` into the .npz fails as on a full disk (ENOSPC half-way through the member)."""
    import errno

    real = np.lib.format.write_array

    def write_array(fh, arr, *args, **kwargs):
        if getattr(getattr(fh, "_zinfo", None), "filename", "").startswith(f"mode_{mode}_"):
            fh.write(b"\x93NUMPY")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fh, arr, *args, **kwargs)
    monkeypatch.setattr(np.lib.format, "write_array", write_array)


def test_a_full_disk_keeps_the_complete_old_pair(model, tmp_path, capsys, monkeypatch):
    """A complete pair, then the same command on a disk that fills up while mode 0 writes its arrays: the old
    pair stays byte-identical (before, a new pair without mode 0's arrays was committed over it, exit 1)."""
    out = tmp_path / "p.npz"
    assert _capture(model, out, ["fp32", "0"], capsys)[0] == 0
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir() if p.is_file())
    _disk_full_for_mode(monkeypatch, "0")
    rc, _, err = _capture(model, out, ["fp32", "0"], capsys)
    monkeypatch.undo()
    assert rc == 2 and "mode 0 could not write its arrays" in err and "No space left on device" in err
    assert "nothing was committed: the existing pair" in err and "was kept unchanged" in err
    assert "Traceback" not in err
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir() if p.is_file()) == before
    assert load_capture(out).manifest["failed_modes"] == []
    fresh = tmp_path / "fresh" / "q.npz"  # no pair to keep: the run's pair is written, the mode recorded as failed
    fresh.parent.mkdir()
    _disk_full_for_mode(monkeypatch, "0")
    rc, _, err = _capture(model, fresh, ["fp32", "0"], capsys)
    assert rc == 1 and "mode 0 failed" in err and "No space left on device" in err
    assert load_capture(fresh).manifest["failed_modes"] == ["0"]


def test_a_mismatched_pair_is_refused_by_every_reader(model, tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    assert _capture(model, a, ["fp32"], capsys)[0] == 0
    assert _capture(model, b, ["fp32", "1"], capsys)[0] == 0
    a.write_bytes(b.read_bytes())  # the .npz replaced behind the harness's back
    with pytest.raises(StorageError, match=r"a.npz does not match .*a_stats.json: the stats file records"):
        load_capture(a)
    rc, _, err = _cli(compare_main, [a], capsys)
    assert rc == 2 and "does not match" in err and "move a_stats.json away" in err
    rc, _, err = _capture(model, a, ["0"], capsys, "--resume")
    assert rc == 2 and "does not match" in err


def test_output_lock(model, tmp_path, capsys):
    out = tmp_path / "c.npz"
    lock = tmp_path / "c.npz.lock"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{sleeper.pid}\n")
        rc, _, err = _capture(model, out, ["fp32"], capsys)
        assert rc == 2 and f"another run (pid {sleeper.pid}) is writing c.npz" in err and not out.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    rc, _, err = _capture(model, out, ["fp32"], capsys)  # the lock's process is gone: stale, taken over
    assert rc == 0, err
    assert out.exists() and not lock.exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_follow_the_umask(model, tmp_path, capsys, umask, mode):
    old = os.umask(umask)
    try:
        out = tmp_path / "c.npz"
        assert _capture(model, out, ["fp32"], capsys, "--no_cache")[0] == 0
        assert _cli(compare_main, [out, "--json", tmp_path / "j.json"], capsys)[0] == 0
    finally:
        os.umask(old)
    for f in (out, stats_path(out), tmp_path / "j.json"):
        assert stat.S_IMODE(f.stat().st_mode) == mode


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """Embedding x 1e7: fp16 activations (mode 1, calibration) overflow, fp32 does not."""
    m = make_hf_model(n_layer=1, seed=5)
    with torch.no_grad():
        m.backbone.embeddings.weight.mul_(1e7)
    return write_hf_dir(tmp_path_factory.mktemp("ov") / "big", m)


def test_fp16_overflow_is_reported_kept_and_exit_1(overflowing, tmp_path, capsys):
    out = tmp_path / "c.npz"
    rc, _, err = _capture(overflowing, out, ["fp32", "1", "0"], capsys)  # was: "math domain error", no file
    assert rc == 1
    assert "mode 1 produced non-finite values (its arrays are kept): input: 0 NaN and" in err
    assert "calibration gave scales that are not finite and positive in layer 0" in err
    assert not list((tmp_path / "cache").glob("*"))  # a non-finite scale is never cached
    cf = load_capture(out)
    entry = cf.manifest["modes"]["1"]
    assert entry["status"] == "error" and "first at (0, 0, 0)" in entry["error"]
    assert cf.manifest["failed_modes"] == ["1", "0"] and cf.manifest["modes"]["fp32"]["status"] == "ok"
    inp = cf.array("1", "input")
    meta = entry["tensors"]["input"]
    assert meta["capture_dtype"] in ("float16", "float32")
    assert meta["overflow_upper"] == pytest.approx((inp == np.inf).mean())
    assert meta["overflow_lower"] == pytest.approx((inp == -np.inf).mean())
    assert meta["overflow_upper"] > 0 and meta["overflow_lower"] > 0
    assert cf.manifest["modes"]["fp32"]["tensors"]["input"]["overflow_upper"] == 0.0
    row = cf.manifest["comparison"]["modes"]["1"]["input"]
    assert row["sqnr_db"] is None and "Inf values (first at (0, 0, 0))" in row["undefined"]["sqnr_db"]
    rc, stdout, err = _cli(compare_main, [out, "--fail-if", "sqnr_db < -1000"], capsys)
    assert rc == 1 and "nan = undefined: 1 input" in stdout and "1 input" in err  # NaN is never a pass


def test_cache_with_bad_scales_is_recomputed_even_with_a_valid_checksum(model, tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert _capture(model, out, ["fp32", "0"], capsys)[0] == 0
    good = load_capture(out).manifest["provenance"]["calibration"]
    for bad in (float("inf"), 0.0, -0.5):  # non-finite, zero, negative
        (path,) = (tmp_path / "cache").glob("calib-*.npz")
        edit_cache_entry(path, lambda payload: payload["scales"].update(s_xz=bad))
        rc, _, err = _capture(model, out, ["fp32", "0"], capsys)
        assert rc == 0 and "scales that are not finite and positive: s_xz=" in err
        info = load_capture(out).manifest["provenance"]["calibration"]
        assert info["source"] == "recomputed" and "not finite and positive" in info["reason"]
        assert info["observers"] == good["observers"]


def _research_file(path, **arrays):
    meta = dict(timestamp=np.array("t"), model=np.array("m"), pretrained_dir=np.array("p"), seq_len=np.array(4))
    np.savez(path, **meta, **arrays)
    return path


def test_comparator_never_crashes_on_bad_numbers(tmp_path, capsys):
    ref = np.linspace(-1, 1, 24, dtype=np.float32).reshape(1, 4, 6)
    nan, inf = ref.copy(), ref.copy()
    nan[0, 2, 3] = np.nan
    inf[0, 1, 1] = -np.inf
    f = _research_file(tmp_path / "r.npz", mode_fp32_output=ref, mode_fp32_input=np.zeros((1, 0, 6), np.float32),
                       **{"mode_a_output": nan, "mode_b_output": inf, "mode_c_output": ref[:, :2],
                          "mode_a_input": np.zeros((1, 0, 6), np.float32), "mode_d_output": np.zeros_like(ref)})
    rc, stdout, err = _cli(compare_main, [f, "--json", tmp_path / "o.json"], capsys)
    assert rc == 0, err
    out = json.loads((tmp_path / "o.json").read_text())["modes"]
    assert out["a"]["output"]["mse"] is None and out["a"]["output"]["max_abs_index"] == [0, 2, 3]
    assert "1 NaN and 0 Inf values (first at (0, 2, 3))" in out["a"]["output"]["undefined"]["mse"]
    assert out["b"]["output"]["sqnr_db"] is None and out["a"]["input"]["undefined"]["mse"] == "both arrays are empty"
    assert out["d"]["output"]["sqnr_db"] == 0.0 and out["d"]["output"]["cosine"] is None
    assert "an array is all zeros" in out["d"]["output"]["undefined"]["cosine"]
    assert "not compared: c output: shape [1, 2, 6] differs" in stdout and "nan = undefined: a output" in stdout
    assert _cli(compare_main, [f, "--fail-if", "sqnr_db < -1000"], capsys)[0] == 1  # NaN metrics fail
    assert _cli(compare_main, [f, "--modes", "d", "--fail-if", "sqnr_db < -1000"], capsys)[0] == 0
    rc, _, err = _cli(compare_main, [f, "--modes", "c", "--fail-if", "mse > 1"], capsys)
    assert rc == 1 and "nothing was compared" in err  # only a mismatched shape: nothing compared is a failure


def test_resume_runs_again_a_mode_whose_recipe_changed(model, tmp_path, capsys):
    out, modes_file = tmp_path / "c.npz", tmp_path / "m.json"
    modes_file.write_text(json.dumps({"modes": {"u": {"base": "fp32", "weights": "fp16"}}}))
    assert _capture(model, out, ["fp32", "u"], capsys, "--modes_file", modes_file)[0] == 0
    first = np.array(load_capture(out).array("u", "output"))
    modes_file.write_text(json.dumps({"modes": {"u": {"base": "fp32"}}}))
    rc, _, err = _capture(model, out, ["u"], capsys, "--modes_file", modes_file, "--resume")
    assert rc == 0 and "mode u in" in err and "was made with another recipe" in err
    cf = load_capture(out)
    assert cf.manifest["modes"]["u"]["recipe"]["weights"] == "fp32" and "resumed" not in cf.manifest["modes"]["u"]
    assert np.array_equal(cf.array("u", "output"), cf.array("fp32", "output"))
    assert not np.array_equal(first, cf.array("u", "output"))
