"""Reading what a user has: every key plain np.load expects, the reader's names, the JSON number
convention, and crafted stats files or .npy headers refused with the field named (issue 21, items 11, 15b)."""
from __future__ import annotations

import copy
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from harness.cli import report_main, capture_main, compare_main
from harness.store.files import StorageError
from harness.store.format import stats_path
from harness.store.reader import load_capture
from harness.store.schema import check_stats, nesting_depth
from helpers import FAST_CLI, run_cli

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba-tiny"
MODES = ["fp32", "0", "2-0", "2-1"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """A run with taps, two layers, samples, end-to-end and sensitivity: every section of the stats."""
    d = tmp_path_factory.mktemp("schema")
    out = d / "rich.npz"
    assert run_cli(capture_main, ["--model", MODEL, "--modes", *MODES, "--output_file", out, "--cache_dir", d / "c",
                                  "--layers", "0", "1", "--taps", "all", "--isolated", "--samples", "2",
                                  "--sensitivity", "--quiet", *FAST_CLI]) == 0
    return out


def test_every_key_plain_numpy_expects_is_stored_by_default(pair, tmp_path):
    """Item 11: without --dedup every mode's every tap has its own key, so np.load(f)[key] works; --dedup
    stores identical arrays once and load_capture resolves the aliases to the same values."""
    with np.load(pair) as z:
        keys = set(z.files)
        assert {"mode_2-0__L0.ssm.out", "mode_fp32__L0.x_proj.in", "mode_2-1__L1.ssm.out"} <= keys
    stats = json.loads(stats_path(pair).read_text())
    assert stats["aliases"] == {} and stats["schema_version"] == 3
    small = tmp_path / "dedup.npz"
    assert run_cli(capture_main, ["--model", MODEL, "--modes", *MODES, "--output_file", small, "--cache_dir",
                                  tmp_path / "c", "--layers", "0", "1", "--taps", "all", "--dedup", "--quiet",
                                  *FAST_CLI]) == 0
    aliases = json.loads(stats_path(small).read_text())["aliases"]
    assert aliases and all(key in keys for key in aliases)  # every key the dedup run left out is in the default run
    cf, full = load_capture(small), load_capture(pair)
    with np.load(small) as z:
        assert not set(aliases) & set(z.files)
    for key in aliases:
        mode, tensor = key[5:].split("__")
        assert np.array_equal(cf.array(mode, tensor), full.array(mode, tensor)[0])  # `pair` has 2 samples


def test_reader_takes_points_and_lists_valid_names(pair):
    """Item 11: CaptureFile.array accepts a capture point (layer 0's block output is stored as "output");
    an unknown mode or tensor lists what the file holds."""
    cf = load_capture(pair)
    assert np.array_equal(cf.array("2-0", "L0.block.out"), cf.array("2-0", "output"))
    assert cf.tensor_meta("0", "L0.block.out")["point"] == "L0.block.out"
    with pytest.raises(StorageError, match=r"mode 0 has no tensor 'L0.nope'; it has: input, .*output"):
        cf.array("0", "L0.nope")
    with pytest.raises(StorageError, match=r"no mode '7' in the file; modes: fp32, 0, 2-0, 2-1"):
        cf.array("7", "output")


def test_infinite_sqnr_is_a_number_numpy_users_compare(pair, tmp_path):
    """Item 11: a bit-identical tensor's SQNR is +inf in the stats and in compare --json, written as the JSON
    number 1e999 (strict JSON, parsed as inf), not the string "inf" (modes 0 and 2-0 compute the same)."""
    out = tmp_path / "same.npz"
    assert run_cli(capture_main, ["--model", MODEL, "--modes", "0", "2-0", "--reference", "0", "--output_file", out,
                                  "--cache_dir", tmp_path / "c", "--quiet", *FAST_CLI]) == 0
    text = stats_path(out).read_text()
    stats = json.loads(text, parse_constant=lambda t: pytest.fail(f"non-standard token {t}"))
    row = stats["comparison"]["modes"]["2-0"]["output"]
    assert row["identical"] is True and row["sqnr_db"] == float("inf") and np.isinf(np.float64(row["sqnr_db"]))
    assert '"inf"' not in text and "1e999" in text
    assert run_cli(compare_main, [pair, "--json", tmp_path / "c.json", "--reference", "0", "--modes", "2-0"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["modes"]["2-0"]["output"]["sqnr_db"] == np.inf


def _crafted(stats: dict) -> list[tuple[str, dict]]:
    """The crafted manifests of issue 21 item 15b (and more of the same kind), each with the field it breaks."""
    tensor = next(t for t, e in stats["modes"]["0"]["tensors"].items() if e.get("scale"))

    def edit(path: tuple, value):
        s = copy.deepcopy(stats)
        node = s
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return s
    deep: object = 1
    for _ in range(900):
        deep = {"x": deep}
    cases = [
        (("provenance",), [1]), (("provenance", "model"), "x"), (("provenance", "calibration"), [2]),
        (("end_to_end", "0", "kl", "ci95"), [0.5]), (("end_to_end", "0", "kl", "ci95"), 0.5),
        (("end_to_end", "0", "kl", "ci95"), [10.0, 11.0]), (("end_to_end", "0", "kl"), "high"),
        (("sensitivity",), [1]), (("sensitivity", "0"), "x"), (("modes", "0", "tensors", "output"), "s"),
        (("modes", "0", "tensors", tensor, "scale"), "nan"), (("modes", "0", "tensors", tensor, "scale"), -1.0),
        (("modes", "0", "tensors", tensor, "scale"), 0), (("modes", "0", "tensors"), []),
        (("modes", "0", "recipe"), "int8"), (("modes", "0", "status"), 3), (("modes", "0", "tensors", "output", "shape"), "x"),
        (("comparison",), []), (("comparison", "modes", "0"), [1]), (("comparison", "modes", "0", "output"), 1.0),
        (("comparison", "modes", "0", "output", "sqnr_db"), "big"), (("comparison", "identical_groups"), "0"),
        (("comparison", "skipped"), [1]), (("failed_modes",), "0"), (("samples",), [1]), (("samples", "metrics"), 1),
        (("samples", "metrics", "0", "output", "sqnr_db", "ci95"), [1]), (("samples", "pairs"), {}),
        (("samples", "pairs", 0, "ci95"), [1e9, 2e9]), (("samples", "windows"), "x"), (("command",), "run"),
        (("stats_only",), "no"), (("seq_len",), "16"), (("aliases",), {"mode_0__L0.x": 1}), (("deep",), deep),
    ]
    return [(".".join(map(str, path)), edit(path, value)) for path, value in cases]


def test_every_crafted_stats_file_is_refused_naming_its_field(pair, tmp_path, capsys):
    """Item 15b: a valid pair (its sha256 matches) with a crafted manifest: report and compare exit 2 naming
    the field (they crashed in 26 and 3 of 33 such cases), never a traceback."""
    stats = json.loads(stats_path(pair).read_text())
    crafted = _crafted(stats)
    assert len(crafted) >= 33
    for n, (field, manifest) in enumerate(crafted):
        npz = tmp_path / f"c{n}.npz"
        npz.write_bytes(pair.read_bytes())
        stats_path(npz).write_text(json.dumps(manifest))
        shown = field.split(".")[0]
        for main, argv in ((compare_main, [npz]), (report_main, [npz, "-o", tmp_path / f"r{n}.html"])):
            capsys.readouterr()
            assert run_cli(main, argv) == 2, (field, main.__name__)
            err = capsys.readouterr().err
            assert "is not a valid stats file" in err and (shown in err or "nests" in err), (field, err)
        assert not (tmp_path / f"r{n}.html").exists()


def test_the_schema_accepts_every_stats_file_a_run_writes(pair):
    """The other half of the check: nothing a run writes (all sections present) is refused."""
    stats = json.loads(stats_path(pair).read_text())
    assert {"comparison", "samples", "end_to_end", "sensitivity", "provenance"} <= set(stats)
    check_stats(stats, "x")
    assert nesting_depth(stats, 24) <= 8


def test_a_header_declaring_more_data_than_the_member_holds_is_refused(tmp_path, capsys):
    """Item 15b: a .npy member declaring (1e5, 1e5, 1e5) float32 over 64 bytes is a bad file (exit 2 naming
    the member), refused from its header before numpy allocates 4 PB (a MemoryError traceback before)."""
    header = {"descr": "<f4", "fortran_order": False, "shape": (100000, 100000, 100000)}
    member = _npy_bytes(header, b"\0" * 64)
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("mode_fp32_output.npy", _npy_bytes({**header, "shape": (1, 16)}, b"\0" * 64))
        z.writestr("mode_0_output.npy", member)
    with pytest.raises(StorageError, match=r"mode_0_output.npy declares shape \(100000, 100000, 100000\) of float32 "
                                           r"\(4000000000000000 bytes\) but holds 64 bytes"):
        load_capture(tmp_path / "huge.npz").array("0", "output")
    assert run_cli(compare_main, [tmp_path / "huge.npz"]) == 2
    assert "declares shape (100000, 100000, 100000)" in capsys.readouterr().err
    # one byte short of what the header declares is refused as well (a truncated member)
    with zipfile.ZipFile(tmp_path / "short.npz", "w") as z:
        z.writestr("mode_0_output.npy", _npy_bytes({**header, "shape": (1, 16)}, b"\0" * 63))
    with pytest.raises(StorageError, match="holds 63 bytes"):
        load_capture(tmp_path / "short.npz").array("0", "output")


def _npy_bytes(header: dict, data: bytes) -> bytes:
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + data


def test_a_member_of_an_unknown_npy_version_is_refused_naming_it(tmp_path):
    """A .npy header of a format version capture arrays never use (3.0) is a bad file whose message names the
    version (a mutant that dropped the message survived)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (1, 4)})
    member = bytearray(buf.getvalue() + b"\0" * 16)
    member[6:8] = bytes([3, 0])  # the version bytes after the magic string
    with zipfile.ZipFile(tmp_path / "v3.npz", "w") as z:
        z.writestr("mode_0_output.npy", bytes(member))
    with pytest.raises(StorageError, match=r"member mode_0_output\.npy is not a readable \.npy array \(ValueError: "
                                           r"\.npy format version 3\.0 \(capture arrays are 1\.0 or 2\.0\)\)"):
        load_capture(tmp_path / "v3.npz").array("0", "output")


def test_a_value_no_alternative_accepts_names_every_alternatives_problem():
    """A field that may be one of several kinds (a recipe knob: a string, a number, a boolean or a table) says what
    each kind would have needed, not only that it is wrong."""
    with pytest.raises(StorageError) as e:
        check_stats({"modes": {"0": {"recipe": {"bits": [1]}}}}, "x_stats.json")
    assert str(e.value) == ("x_stats.json is not a valid stats file: field modes.0.recipe.bits: expected a string, "
                            "got a list or expected a number, got a list ([1]) or expected true or false, got a list "
                            "or expected an object, got a list")


@pytest.mark.parametrize("ci95, ok", [([0.5, 1.0 - 1e-9], True), ([1.0 + 1e-9, 2.0], True),
                                      ([0.5, 1.0 - 1.5e-9], False), ([1.0 + 1.5e-9, 2.0], False)])
def test_an_interval_may_miss_its_centre_by_a_billionth_inclusive(ci95, ok):
    """A centre computed apart from its bounds may round outside them: within 1e-9 (relative, bound included:
    here hi + 1e-9 is exactly the centre) the interval still contains it; beyond, the file is refused."""
    manifest = {"end_to_end": {"0": {"kl": {"mean": 1.0, "ci95": ci95}}}}
    if ok:
        check_stats(manifest, "x_stats.json")
    else:
        with pytest.raises(StorageError, match="does not contain its mean 1.0"):
            check_stats(manifest, "x_stats.json")
