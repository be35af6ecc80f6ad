"""The calibration cache key changes with every setting and input that changes the scales, and with nothing else."""
import dataclasses

import pytest
import torch

import harness.recipes.quamba.calibration as calibration
import harness.runner.calibration as runner_calibration
from harness.runner.calibration import CalibrationSettings, layer_keys as _keys_of_prep
from harness.recipes.quamba.calibration import calibrate
from harness.checkpoints.loading import open_checkpoint
from harness.runner.weightbank import WeightBank
from helpers import cache_entry, edit_cache_entry

BASE = CalibrationSettings(num_samples=4, seqlen=16, alpha=0.9995, batch_size=2, seed=42)


def _layer_keys(prefix, windows, settings, prep="quamba"):
    return _keys_of_prep(prefix, windows, settings, prep)


def _entry(cache_dir, key):
    """Where the Quamba1 calibration's entry under `key` lives (runner.layercache, kind "calib")."""
    return calibration._cache(cache_dir).path(key)


@pytest.fixture(scope="module")
def setup(hf_dir):
    ckpt = open_checkpoint(hf_dir)
    windows = torch.randint(0, ckpt.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    return ckpt, windows, ckpt.prefix_hashes(1)


@pytest.mark.parametrize("field, value", [("num_samples", 8), ("seqlen", 32), ("alpha", 0.999), ("batch_size", 4),
                                          ("seed", 0)])
def test_every_setting_enters_the_key(setup, field, value):
    _, windows, prefix = setup
    base = _layer_keys(prefix, windows, BASE)
    other = _layer_keys(prefix, windows, dataclasses.replace(BASE, **{field: value}))
    assert all(a != b for a, b in zip(base, other))


def test_the_tokens_and_the_model_enter_the_key(setup):
    _, windows, prefix = setup
    base = _layer_keys(prefix, windows, BASE)
    changed = windows.clone()
    changed[3, 15] += 1                                                       # one token of one window
    assert _layer_keys(prefix, changed, BASE)[0] != base[0]
    other_model = prefix[0][:-1] + ("1" if prefix[0][-1] == "0" else "0")
    assert _layer_keys([other_model, prefix[1]], windows, BASE)[0] != base[0]
    assert _layer_keys(prefix, windows, BASE)[1] != base[0]                   # layer 1 has its own key


def test_the_prep_enters_the_key(setup):
    """prep=quamba and prep=exact calibrate different models: one must never reuse the other's scales."""
    _, windows, prefix = setup
    assert all(a != b for a, b in zip(_layer_keys(prefix, windows, BASE, "quamba"),
                                      _layer_keys(prefix, windows, BASE, "exact")))


def test_the_version_enters_the_key(setup, monkeypatch):
    _, windows, prefix = setup
    base = _layer_keys(prefix, windows, BASE)
    monkeypatch.setattr(runner_calibration, "CALIB_VERSION", runner_calibration.CALIB_VERSION + 1)
    assert _layer_keys(prefix, windows, BASE)[0] != base[0]


def test_what_does_not_change_the_scales_does_not_change_the_key(setup):
    _, windows, prefix = setup
    base = _layer_keys(prefix, windows, BASE)
    assert _layer_keys(prefix[:1], windows, BASE) == base[:1]                # deeper layers do not matter
    assert _layer_keys(prefix, windows.to(torch.int32), BASE) == base         # the id dtype does not matter
    assert _layer_keys(list(prefix), windows.clone(), CalibrationSettings(**dataclasses.asdict(BASE))) == base


def test_a_changed_alpha_is_not_reused(setup, tmp_path):
    """The bug of issue 12: a run with another --percentile_alpha reported "reused" with the old scales."""
    ckpt, windows, prefix = setup
    bank = WeightBank(ckpt)
    first = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    again = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    other = calibrate(bank, windows, dataclasses.replace(BASE, alpha=0.99), 0, prefix, tmp_path)
    assert (first.info["source"], again.info["source"], other.info["source"]) == ("computed", "reused", "computed")
    assert again.scales == first.scales
    # the reused result names the files it came from and took no time (mutants that dropped or emptied the
    # file list, or reported a second, survived)
    assert again.info["cache_files"] == first.info["cache_files"] == [str(_entry(tmp_path, first.info["keys"][0]))]
    assert again.info["seconds"] == 0.0 and first.info["seconds"] > 0
    assert other.scales[0].s_u != first.scales[0].s_u                          # percentile scales moved
    assert other.scales[0].s_xz == first.scales[0].s_xz                        # min-max scales did not
    assert len(list(tmp_path.iterdir())) == 2


def test_a_deeper_run_reuses_the_shallow_layers_and_a_shallow_run_the_deeper_file(setup, tmp_path):
    ckpt, windows, prefix = setup
    bank = WeightBank(ckpt)
    deep = calibrate(bank, windows, BASE, 1, prefix, tmp_path)
    shallow = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    assert shallow.info["source"] == "reused" and shallow.scales == deep.scales[:1]
    assert shallow.info["keys"] == deep.info["keys"][:1]


def test_an_entry_under_another_key_is_not_used(setup, tmp_path):
    ckpt, windows, prefix = setup
    bank = WeightBank(ckpt)
    first = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    other_key = _layer_keys(prefix, windows, dataclasses.replace(BASE, seed=1))[0]
    _entry(tmp_path, first.info["keys"][0]).rename(_entry(tmp_path, other_key))
    moved = calibrate(bank, windows, dataclasses.replace(BASE, seed=1), 0, prefix, tmp_path)
    assert moved.info["source"] == "recomputed" and "key mismatch" in moved.info["reason"]


def test_cache_file_records_observers_and_settings(setup, tmp_path):
    """The entry keeps each observer's state (what the scale was computed from) next to the scales."""
    ckpt, windows, prefix = setup
    result = calibrate(WeightBank(ckpt), windows, BASE, 0, prefix, tmp_path, prep="exact")
    header = cache_entry(_entry(tmp_path, result.info["keys"][0]))
    assert (header["kind"], header["key"]) == ("calib", result.info["keys"][0])
    data = header["payload"]
    assert data["settings"] == dataclasses.asdict(BASE) and data["layer"] == 0
    assert data["prep"] == "exact"  # the calibration's own prep (a mutant that wrote None survived)
    assert set(data["observers"]) == set(data["scales"]) == {"s_in", "s_xz", "s_u", "s_xp", "s_dt", "s_h", "s_H"}
    assert data["observers"]["s_u"]["alpha"] == BASE.alpha and data["observers"]["s_u"]["samples"] == 4
    assert data["observers"]["s_in"]["samples"] == 4 and data["observers"]["s_in"]["amax"] > 0


@pytest.mark.parametrize("kw, message", [({"alpha": 0.0}, r"--percentile_alpha must be in \(0, 1\], got 0.0"),
                                         ({"alpha": 1.5}, r"--percentile_alpha must be in \(0, 1\], got 1.5"),
                                         ({"batch_size": 0}, "--calib_batch_size must be positive, got 0")])
def test_settings_are_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **kw)
    assert dataclasses.replace(BASE, alpha=1.0).alpha == 1.0


def test_default_cache_dir(monkeypatch, tmp_path):
    from pathlib import Path
    from harness.runner.calibration import default_cache_dir
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "q"))
    assert default_cache_dir() == tmp_path / "q"
    monkeypatch.delenv("QUAMBA_HARNESS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "quamba-harness"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == Path(tmp_path / "home" / ".cache" / "quamba-harness")


def test_run_info_records_what_happened(setup, tmp_path):
    """calibrate's info goes into the capture's provenance: settings, keys, timing, observer states, files."""
    ckpt, windows, prefix = setup
    info = calibrate(WeightBank(ckpt), windows, BASE, 0, prefix, tmp_path).info
    assert info["settings"] == dataclasses.asdict(BASE) and info["tokens"] == windows.numel()
    assert info["source"] == "computed" and isinstance(info["seconds"], float) and info["seconds"] >= 0
    assert set(info["observers"][0]) == {"s_in", "s_xz", "s_u", "s_xp", "s_dt", "s_h", "s_H"}
    assert info["cache_files"] == [str(_entry(tmp_path, info["keys"][0]))]


def test_an_entry_with_bad_scales_is_recomputed(setup, tmp_path):
    """A well-formed, correctly checksummed entry that lacks a scale, or its observers' state, is reported as
    such, never used."""
    ckpt, windows, prefix = setup
    bank = WeightBank(ckpt)
    first = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    path = _entry(tmp_path, first.info["keys"][0])
    edit_cache_entry(path, lambda payload: payload["scales"].pop("s_u"))
    again = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    assert again.info["source"] == "recomputed" and "bad scales ('s_u')" in again.info["reason"]
    assert again.info["observers"] == first.info["observers"]
    edit_cache_entry(path, lambda payload: payload["observers"].pop("s_h"))
    third = calibrate(bank, windows, BASE, 0, prefix, tmp_path)
    assert third.info["source"] == "recomputed" and "bad observers' state (one per scale)" in third.info["reason"]
    fourth = calibrate(bank, windows, BASE, 0, prefix, tmp_path).info  # a reused run records what a fresh one did
    assert fourth == {**{k: v for k, v in third.info.items() if k != "reason"}, "source": "reused", "seconds": 0.0}


def test_calibration_time_and_a_cache_that_cannot_be_written(setup, tmp_path, capsys):
    """info["seconds"] is the calibration's own duration; a cache directory that cannot be written is a
    warning on stderr that names it, and the scales are still computed (mutants that added the start
    time, printed None, or printed to stdout survived)."""
    import time

    ckpt, windows, prefix = setup
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    start = time.perf_counter()
    out = calibrate(WeightBank(ckpt), windows, BASE, 0, prefix, blocked / "cache")
    took = time.perf_counter() - start
    assert out.info["source"] == "computed" and 0 <= out.info["seconds"] <= took + 1e-3
    assert out.info["seconds"] == round(out.info["seconds"], 3)  # milliseconds, as every time in the stats
    captured = capsys.readouterr()
    assert f"warning: cannot write the calibration cache in {blocked / 'cache'}" in captured.err
    assert "the scales of this run are not cached" in captured.err and "warning" not in captured.out
    # the provenance keeps the reason (mutants that recorded None, "None" or another key survived)
    assert "Not a directory" in out.info["cache_error"] and str(blocked) in out.info["cache_error"]
    assert "cache_files" not in out.info


def test_cache_entry_round_trip_and_every_refusal_names_its_reason(tmp_path):
    """The calibration's entry at the unit level (the pipeline tests that cover it are outside the mutation run):
    written into directories that do not exist yet, it records version, prep, layer, settings and the observers'
    state, and reads back the scales and that state; the cache's refusals (another key, an edited scale, a file
    of the cache before this one's format) and the recipe's own (a scale missing or not positive) each name
    their reason."""
    from harness.runner.layercache import BadEntry
    from harness.spec import SCALE_NAMES, LayerScales
    scales = LayerScales(**{n: 0.5 + k / 8 for k, n in enumerate(SCALE_NAMES)})
    state = {n: {"amax": k, "samples": 4} for k, n in enumerate(SCALE_NAMES)}
    cache = calibration._cache(tmp_path / "a" / "b")
    path = cache.write("k0", calibration._payload(0, scales, state, CalibrationSettings(4, 32), "exact"))
    data = cache_entry(path)
    assert (data["version"], data["kind"], data["key"]) == (1, "calib", "k0")
    assert {k: data["payload"][k] for k in ("version", "prep", "layer", "settings")} == \
        {"version": runner_calibration.CALIB_VERSION, "prep": "exact", "layer": 0,
         "settings": dataclasses.asdict(CalibrationSettings(4, 32))}
    assert calibration._parse_entry(cache.read("k0")) == (scales, state)
    edit_cache_entry(path, lambda p: p["scales"].update(s_u=-p["scales"]["s_u"]))
    with pytest.raises(ValueError, match=r"^scales that are not finite and positive: s_u=-0.75$"):
        calibration._parse_entry(cache.read("k0"))
    with pytest.raises(ValueError, match=r"^bad scales \('s_xz'\)$"):
        calibration._parse_entry(dataclasses.replace(cache.read("k0"), payload={"scales": {"s_in": 1.0}}))
    assert cache.read("k1") is None
    path.rename(cache.path("k1"))
    with pytest.raises(BadEntry, match="^key mismatch$"):
        cache.read("k1")
    cache.path("k1").write_text('{"format": "quamba-harness-calibration", "key": "k1"}')
    with pytest.raises(BadEntry, match=r"^not a cache entry \(not an .npz file\)$"):
        cache.read("k1")


def test_the_calibration_model_scans_in_mamba_ssms_order(setup, monkeypatch):
    """Quamba calibrates its fp16 model with mamba_ssm's selective_scan (spec notes §1.3): run_observers builds the
    calibration model, whose scan order is MAMBA whatever the recipe's ssm_impl (mutants that built the
    mode's own model survived: one fp32 ulp in the scan rarely moves an fp16 percentile)."""
    from harness.kernels.scan import ScanOrder
    ckpt, windows, _ = setup
    built = []
    real = calibration.build_backbone
    monkeypatch.setattr(calibration, "build_backbone", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    calibration.run_observers(WeightBank(ckpt), windows[:2], 1, 0.9995, 2, "quamba")
    assert [b.ssm.order for b in built[0].blocks] == [ScanOrder.MAMBA, ScanOrder.MAMBA]


def test_a_batch_of_one_window_is_valid():
    """--calib_batch_size 1 is the smallest valid batch (a mutant that refused it survived)."""
    assert CalibrationSettings(batch_size=1).batch_size == 1
    with pytest.raises(ValueError, match=r"^--calib_batch_size must be positive, got 0$"):
        CalibrationSettings(batch_size=0)


def test_calibrate_observes_the_model_of_its_prep(setup, tmp_path):
    """calibrate(prep=...) runs that prep's calibration model (a mutant that always ran prep=quamba's survived
    the run-info test)."""
    ckpt, windows, prefix = setup
    bank = WeightBank(ckpt)
    exact = calibrate(bank, windows, BASE, 0, prefix, None, prep="exact").scales
    want, _ = calibration.run_observers(bank, windows, 0, BASE.alpha, BASE.batch_size, "exact")
    other, _ = calibration.run_observers(bank, windows, 0, BASE.alpha, BASE.batch_size, "quamba")
    assert exact == want and exact != other


def test_a_quamba2_cache_file_past_16_mib_is_refused_unparsed(tmp_path):
    """A Quamba2 calibration cache entry is a few KB: a file past 16 MiB (here one byte past) is refused by its
    size before it is parsed."""
    from harness.recipes.quamba.q2.calibrate import _cache
    path = _cache(tmp_path).path("k")
    path.write_bytes(b" " * ((1 << 24) + 1))
    with pytest.raises(ValueError, match=f"^it is larger than {1 << 24} bytes$"):
        _cache(tmp_path).read("k")
