"""Every command runs guarded: SIGINT/SIGTERM become a clean exit with one line saying what was kept."""
from __future__ import annotations

import sys

__all__ = ["guarded"]


def guarded(command, argv: list[str] | None, prog: str | None) -> int:
    """Run command(argv, prog, progress) with SIGINT/SIGTERM turned into a clean exit (130/143, one line
    saying what the command was doing and what is on disk, no traceback)."""
    from ..runtime.guard import Interrupted, Progress, handle_signals

    progress = Progress.on_stderr()  # the long phases shown while they run (capture, export; not with --quiet)
    try:
        with handle_signals():
            return command(argv, prog, progress)
    except Interrupted as e:
        print(f"interrupted by {e.name} while {progress.phase}: {progress.kept()}", file=sys.stderr)
        return e.exit_code
