"""``python -m harness.lmeval run --model quamba-harness --model_args pretrained=DIR mode=2-1 --tasks T ...``:
lm-eval's own command line (lm-eval 0.4.13, ``lm_eval.__main__.cli_evaluate``) with the ``quamba-harness`` model
registered and, unless the command names an ``--include_path``, the local tasks (quamba_lastword,
quamba_rolling) written with absolute data paths to a temporary directory and included."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import MODEL_NAME  # noqa: F401  (registers quamba-harness)
    from .tasks import write_local_tasks

    args = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="quamba-lmeval-tasks-") as local:
        if args[:1] == ["run"] and not any(a.startswith("--include_path") for a in args):
            args += ["--include_path", str(write_local_tasks(Path(local)))]
        sys.argv = [sys.argv[0]] + args
        cli_evaluate()


if __name__ == "__main__":
    main()
