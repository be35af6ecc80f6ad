"""`import harness` has no side effects; its public names load on first use; `python -m harness --help` lists the commands."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**clean, **(env or {})})


def test_import_changes_no_signal_handler_environment_or_import_of_torch():
    r = _python("import os, signal, sys\n"
                "before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))\n"
                "import harness\n"
                "assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before\n"
                "assert 'OPENBLAS_NUM_THREADS' not in os.environ\n"
                "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
                "print(harness.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == __import__("harness").__version__


def test_public_names_load_on_first_use():
    import harness
    from harness.runner.pipeline import RunConfig, run
    from harness.store.reader import load_capture
    assert harness.RunConfig is RunConfig and harness.run is run and harness.load_capture is load_capture
    from harness import CalibrationSettings  # the README tells users to pass one as RunConfig.calib
    from harness.runner.calibration import CalibrationSettings as defined
    assert CalibrationSettings is defined and RunConfig(calib=CalibrationSettings()).calib == defined()
    assert set(harness.__all__) <= set(dir(harness))
    try:
        harness.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("harness.no_such_name did not raise")


def test_help_exits_0_and_lists_every_command():
    r = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stderr == ""
    for command in ("capture", "compare", "report", "export", "modes", "points"):
        assert f"\n  {command} " in r.stdout
    bad = subprocess.run([sys.executable, "-m", "harness", "nope"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr and "capture" in bad.stderr


def test_entry_points_limit_numpys_blas_threads_unless_the_user_chose():
    from harness.runtime.startup import begin, imported
    code = "from harness.runtime.startup import begin; begin(); import os; print(os.environ['OPENBLAS_NUM_THREADS'])"
    assert _python(code).stdout.strip() == "1"
    assert _python(code, {"OPENBLAS_NUM_THREADS": "3"}).stdout.strip() == "3"
    assert callable(begin) and callable(imported)


def test_library_code_reports_through_the_harness_logger_not_print():
    """One channel: no print() in the library below the command line and the report command; a warning
    goes through logging.getLogger("harness") and reads `warning: ...` on stderr, as the CLI printed it."""
    import ast
    import contextlib
    import io
    import logging

    for path in (ROOT / "harness").rglob("*.py"):
        rel = path.relative_to(ROOT / "harness").as_posix()
        if rel.startswith("cli/") or rel in ("__init__.py", "runtime/log.py", "runtime/startup.py",
                                              "report/build.py"):  # entry points
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
        assert calls == [], f"{rel} prints (line {calls[0].lineno})"
    from harness.runtime.log import warn
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("harness").addHandler(handler)
    try:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            warn("the cache is read-only")
    finally:
        logging.getLogger("harness").removeHandler(handler)
    assert err.getvalue() == "warning: the cache is read-only\n" and seen[0].getMessage() == "the cache is read-only"
