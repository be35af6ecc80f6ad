"""`python -m harness` and the `quamba-harness` script: quiet start, then the command line."""
import sys

from .runtime.startup import begin, imported


def entry() -> int:
    begin()
    from .cli import main, preload
    preload(sys.argv[1] if len(sys.argv) > 1 else None)
    imported(restore=True)
    return main()


if __name__ == "__main__":
    sys.exit(entry())
