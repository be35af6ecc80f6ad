"""`python -m harness` and the `quamba-harness` script: quiet start, then the command line."""
import sys

from .runtime.startup import begin, imported


def entry() -> int:
    begin()
    from .cli import main
    imported(restore=True)
    return main()


if __name__ == "__main__":
    sys.exit(entry())
