"""Special files are refused before they are read, wherever the harness reads a file (docs/guarantees.md).

A FIFO where a file is read blocks the reader forever (its open waits for a writer), and a link to /dev/zero
never ends: each case runs under a time limit (SIGALRM) and a memory limit (RLIMIT_DATA), so that a reader
that does open one fails the test instead of hanging it or filling the memory.
"""
import json
import os
import resource
import shutil
import signal
from contextlib import contextmanager

import pytest

from conftest import make_hf_model, write_hf_dir
from helpers import FAST_CLI, run_cli
from harness.cli import capture_main, compare_main, export_main
from harness.store.format import stats_path

FAST = FAST_CLI
_main = run_cli


def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


class Blocked(BaseException):
    """The time limit of `bounded` (not an OSError, which a reader could take for an unreadable file)."""


@contextmanager
def bounded(seconds: int = 60, more_bytes: int = 2 << 30):
    """At most `seconds` and `more_bytes` of data memory more than now; raises Blocked / MemoryError."""
    def timeout(_signum, _frame):
        raise Blocked(f"still running after {seconds} s: a special file was opened and blocks")

    limit = resource.getrlimit(resource.RLIMIT_DATA)
    previous = signal.signal(signal.SIGALRM, timeout)
    resource.setrlimit(resource.RLIMIT_DATA, (_data_bytes() + more_bytes, limit[1]))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_DATA, limit)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("special")
    write_hf_dir(d / "m", make_hf_model(n_layer=1, seed=11))
    assert _main(capture_main, ["--model", d / "m", "--modes", "fp32", "--output_file", d / "good.npz",
                                "--no_cache", "--quiet", *FAST]) == 0
    return d


def _special(path, kind):
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


def _sharded(model):
    """The model's weights behind an index naming one shard."""
    (model / "model.safetensors").rename(model / "model-00001.safetensors")
    keys = json.loads(bytes(_header(model / "model-00001.safetensors")))
    keys.pop("__metadata__", None)
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model-00001.safetensors" for k in keys}}))
    return model / "model-00001.safetensors"


def _header(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return data[8:8 + n]


# (case id, file made special (relative to a fresh copy of the model, or "@name" for a file beside it),
#  command, expected fragment of the message)
CASES = [
    ("config-fifo", "config.json", "capture", "config.json is a FIFO"),
    ("config-dev-zero", "config.json", "capture", "config.json is a character device"),
    ("config-fifo-export", "config.json", "export", "config.json is a FIFO"),
    ("weights-fifo", "model.safetensors", "capture", "model.safetensors is a FIFO"),
    ("weights-dev-zero", "model.safetensors", "capture", "model.safetensors is a character device"),
    ("shard-fifo", "shard", "capture", "model-00001.safetensors is a FIFO"),
    ("index-fifo", "index", "capture", "model.safetensors.index.json is a FIFO"),
    ("tokenizer-fifo", "tokenizer.json", "capture", "tokenizer.json is a FIFO"),
    ("tokenizer-dev-zero", "tokenizer.json", "capture", "tokenizer.json is a character device"),
    ("tokenizer-extra-fifo-export", "tokenizer_config.json", "export", "tokenizer_config.json is a FIFO"),
    ("text-fifo", "@text.txt", "capture", "text.txt is a FIFO"),
    ("calib-fifo", "@calib.txt", "capture", "calib.txt is a FIFO"),
    ("modes-file-fifo", "@modes.json", "capture", "modes.json is not a regular file"),
    ("lock-fifo", "@out.npz.lock", "capture", "out.npz.lock is not a regular file"),
    ("stats-fifo", "@good_stats.json", "compare", "good_stats.json: it is a FIFO"),
    ("capture-fifo", "@good.npz", "compare", "good.npz is a FIFO"),
]


@pytest.mark.parametrize("case,target,command,fragment", CASES, ids=[c[0] for c in CASES])
def test_a_special_file_is_refused_before_it_is_read(base, tmp_path, capsys, case, target, command, fragment):
    model = tmp_path / "m"
    shutil.copytree(base / "m", model)
    for name in ("good.npz", "good_stats.json"):
        shutil.copy(base / name, tmp_path / name)
    (tmp_path / "text.txt").write_text("to be or not to be " * 40)
    (tmp_path / "calib.txt").write_text("to be or not to be " * 40)
    (tmp_path / "modes.json").write_text('{"modes": {"u": {"base": "2-4"}}}')
    (model / "tokenizer_config.json").write_text("{}")
    if target == "shard":
        path = _sharded(model)
    elif target == "index":
        _sharded(model)
        path = model / "model.safetensors.index.json"
    else:
        path = tmp_path / target[1:] if target.startswith("@") else model / target
    _special(path, "dev-zero" if "dev-zero" in case else "fifo")
    if command == "capture":
        argv = [capture_main, "--model", model, "--modes", "fp32", "0", "--output_file", tmp_path / "out.npz",
                "--no_cache", *FAST]
        argv += {"text": ["--text_file", tmp_path / "text.txt"], "calib": ["--calib_file", tmp_path / "calib.txt"],
                 "modes": ["--modes_file", tmp_path / "modes.json"]}.get(case.split("-")[0], [])
    elif command == "export":
        argv = [export_main, "--model", model, "--output_dir", tmp_path / "q", "--no_cache", *FAST[2:]]
    else:
        argv = [compare_main, tmp_path / "good.npz"]
    with bounded():
        rc = _main(argv[0], argv[1:])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and "Traceback" not in err, err
    assert not (tmp_path / "out.npz").exists() and not (tmp_path / "q").exists()


def test_a_special_file_in_the_calibration_cache_is_recomputed_not_read(base, tmp_path, capsys):
    cache = tmp_path / "cache"
    argv = ["--model", base / "m", "--modes", "0", "--output_file", tmp_path / "out.npz", "--cache_dir", cache, *FAST]
    assert _main(capture_main, argv) == 0
    entry = next(cache.glob("calib-*.npz"))
    _special(entry, "fifo")
    capsys.readouterr()
    with bounded():
        assert _main(capture_main, argv) == 0
    err = capsys.readouterr().err
    assert "is a FIFO" in err and "recomputing the calibration" in err
    stats = json.loads(stats_path(tmp_path / "out.npz").read_text())
    assert stats["provenance"]["calibration"]["source"] == "recomputed"


def test_is_regular_tells_missing_regular_special_and_unreadable_apart(tmp_path):
    from harness.store.files import StorageError, is_regular

    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert is_regular(tmp_path / "f") and not is_regular(tmp_path / "nope") and not is_regular(tmp_path / "f" / "x")
    with pytest.raises(StorageError, match=r"fifo: it is a FIFO, not a regular file$"):
        is_regular(tmp_path / "fifo")
    with pytest.raises(StorageError, match=r"a: it is not readable \(Too many levels of symbolic links\)$"):
        is_regular(tmp_path / "a")       # a loop of links is named, not taken for a missing file
