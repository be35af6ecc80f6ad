"""The architecture registry's order: the built-in architectures first, in BUILTIN_ARCHITECTURES order, whatever
a process imported first, then the plugins' (the first is the default where a command has no model: presets,
python -m harness points). Each case runs in a fresh interpreter, since the order of imports is the point."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ("from harness.architectures.registry import Architecture, register_architecture\n"
          "register_architecture(Architecture('toy', 'a toy', {}, lambda *a: [], lambda *a: None))\n")


def _names_after(code: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code + "\nfrom harness.architectures.registry import architecture_names"
                        "\nprint(' '.join(architecture_names()))"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("first", ["import harness.architectures.mamba1.build",  # registers mamba1 mid-import
                                   "import harness.architectures.mamba2.block",
                                   "import harness.emulation.capture", PLUGIN])
def test_the_built_in_architectures_come_first_in_their_order(first):
    from harness.architectures.registry import BUILTIN_ARCHITECTURES

    names, folders = _names_after(first), [m.rsplit(".", 1)[1] for m in BUILTIN_ARCHITECTURES]
    builtin = [n for n in names if n != "toy"]  # a folder may register more than one (bamba: nemotron_h too)
    assert [n for n in builtin if n in folders] == folders and names[:len(builtin)] == builtin
    assert builtin[:len(folders) - 1] == folders[:-1]  # each folder's own name where its folder comes
    assert names[len(builtin):] == (["toy"] if first == PLUGIN else [])


def test_points_lists_the_first_built_in_architecture_by_default(capsys):
    from harness.architectures.registry import BUILTIN_ARCHITECTURES, get_architecture
    from harness.runner.points import points_main

    first = get_architecture(BUILTIN_ARCHITECTURES[0].rsplit(".", 1)[1])
    lines: list[str] = []
    assert points_main([], lines.append, lines.append) == 0
    assert [line.split()[0] for line in lines][:len(first.points)] == [f"L<i>.{p}" for p in first.points]
