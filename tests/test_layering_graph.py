"""House rules over the whole module graph of harness/: no import cycle, recipe folders and architecture folders
independent of each other, no private name imported from another module, and no recipe or architecture named by
the run. Each rule takes the root it checks, so that each is also shown to catch a probe written into a copy."""
import ast
from pathlib import Path

from test_layering import PKG, harness_copy, harness_imports, module_name


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the harness modules that importing it runs: its own imports (inside functions too) and, for a
    module of another package, that package's __init__ modules (Python runs a package's __init__ first; the
    importer's own packages are already running). A package's __init__.py is a module like any other."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        mine = set(_ancestors(name)) | {name}
        deps = set()
        for imported, _, _ in harness_imports(path, root):
            deps |= {imported} | {p for p in _ancestors(imported) if p not in mine}
        graph[name] = deps - {name}
    return graph


def _shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths, queue = {start: [start]}, [start]
    for v in queue:
        for w in sorted(graph[v] & group):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each group of modules that import each other (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v] & graph.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            if len(group) > 1:
                found.append(_shortest_cycle(graph, group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_counts_imports_in_functions_and_package_inits():
    graph = import_graph()
    assert len(graph) == len(list(PKG.rglob("*.py")))
    assert "runner.pipeline" in graph["cli.capture"]  # imported inside capture_main only
    assert "recipes.quamba.q2.order" in graph["recipes.quamba.q2.checkpoint"]  # inside a function only
    # a package's __init__: its own imports, and it runs before any module of the package imported from outside
    assert {"architectures.registry", "emulation.capture", "emulation"} <= graph["architectures.mamba1"]
    assert "recipes.quamba" not in graph["recipes.quamba.q2.checkpoint"]  # its own package is already running


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_cycle_rule_catches_a_cycle(tmp_path):
    """Two probe modules importing each other (one inside a function) are a cycle, and so is a package
    __init__ that imports a module which imports that package's modules (the rule is not vacuous)."""
    root = harness_copy(tmp_path)
    (root / "emulation" / "_probe_a.py").write_text("from . import _probe_b\n")
    (root / "emulation" / "_probe_b.py").write_text("def f():\n    from ._probe_a import g\n")
    assert cycles(import_graph(root)) == [["emulation._probe_a", "emulation._probe_b", "emulation._probe_a"]]
    (root / "emulation" / "_probe_b.py").unlink()
    (root / "kernels" / "__init__.py").write_text("from ..emulation import modules\n")
    (found,) = cycles(import_graph(root))
    assert found[0] == found[-1] == "emulation.modules" and found[1] == "kernels", found


FOLDERS = ("recipes", "architectures")  # one folder per recipe family, one per block architecture


def folder_of(module: str, root: Path = PKG) -> str | None:
    """recipes/quamba for recipes.quamba.q2.build; None for a module directly under recipes/ or architectures/
    (the registries, shared by every folder) and for any other module."""
    parts = module.split(".")
    if len(parts) > 1 and parts[0] in FOLDERS and (root / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}/{parts[1]}"
    return None


def crossing_imports(root: Path = PKG) -> list[str]:
    """Imports from one recipe folder into another, or from one architecture folder into another."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        mine = folder_of(name, root)
        for imported, _, line in harness_imports(path, root) if mine else ():
            theirs = folder_of(imported, root)
            if theirs and theirs != mine and theirs.split("/")[0] == mine.split("/")[0]:
                found.append(f"{name}:{line} ({mine}) imports {imported} ({theirs})")
    return found


def test_recipe_folders_and_architecture_folders_do_not_import_each_other():
    assert not crossing_imports()


def test_the_folder_rule_catches_a_crossing_import(tmp_path):
    root = harness_copy(tmp_path)
    (root / "recipes" / "float" / "_probe.py").write_text(
        "from ..registry import Recipe\nfrom ..quamba.families import Quamba2\n")
    (root / "architectures" / "mamba2" / "_probe.py").write_text(
        "from ..registry import get_architecture\n\n\ndef f():\n    import harness.architectures.mamba1.weights\n")
    assert crossing_imports(root) == [
        "architectures.mamba2._probe:5 (architectures/mamba2) imports architectures.mamba1.weights (architectures/mamba1)",
        "recipes.float._probe:2 (recipes/float) imports recipes.quamba.families (recipes/quamba)"]


def private_imports(root: Path = PKG) -> list[str]:
    """``from X import _y`` where _y is a private name of another module (not a submodule, not a dunder)."""
    return [f"{module_name(path, root)}:{line} imports {obj} from {imported}"
            for path in sorted(root.rglob("*.py")) for imported, obj, line in harness_imports(path, root)
            if obj and obj.startswith("_") and not obj.startswith("__") and imported != module_name(path, root)]


def test_no_private_name_is_imported_from_another_module():
    assert not private_imports()


def test_the_private_rule_catches_a_private_import(tmp_path):
    """A private name is refused; a private submodule and a dunder are not names of that kind."""
    root = harness_copy(tmp_path)
    (root / "runner" / "_helper.py").write_text("X = 1\n")
    (root / "runner" / "_probe.py").write_text(
        "from . import _helper\nfrom .. import __version__\n\n\ndef f():\n"
        "    from ..emulation.capture import _NAME_RE, point_name\n")
    assert private_imports(root) == ["runner._probe:6 imports _NAME_RE from emulation.capture"]


# The names of the built-in architectures and recipe families ("float" is too common a word to look for).
GENERIC = {"float"}  # a built-in name too common a word to look for


def builtin_names() -> set[str]:
    """The built-in recipe families' and architectures' names (a new built-in folder is looked for at once)."""
    from harness.architectures.registry import architecture_names, get_architecture
    from harness.recipes.registry import get_recipe, recipe_names

    builtin = {n for n in recipe_names() if type(get_recipe(n)).__module__.startswith("harness.")} | \
        {n for n in architecture_names() if get_architecture(n).build_blocks.__module__.startswith("harness.")}
    return builtin - GENERIC
# Where a name may be written: the folders that register them, the numeric spec (ModelDims.architecture), and
# modes/, which holds the built-in mode rows and the knob values (prep=quamba2 is a knob value).
MAY_NAME = ("recipes", "architectures", "spec", "modes")


def named_literals(root: Path = PKG) -> list[str]:
    """String literals equal to a recipe's or an architecture's name outside MAY_NAME, as module:line."""
    names = builtin_names()
    return [f"{module_name(path, root)}:{node.lineno} names {node.value!r}"
            for path in sorted(root.rglob("*.py")) if module_name(path, root).split(".")[0] not in MAY_NAME
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_the_run_never_names_a_recipe_or_an_architecture():
    """The run asks the registries (get_architecture(dims.architecture), recipe_for(mode)) instead."""
    assert not named_literals()


def test_the_names_looked_for_are_the_built_in_ones():
    assert {"mamba1", "mamba2", "quamba1", "quamba2", "quamba2-w4"} <= builtin_names()


def test_the_name_rule_catches_a_name(tmp_path):
    root = harness_copy(tmp_path)
    (root / "runner" / "_probe.py").write_text(
        'ARCH = "mamba2"  # a comment naming mamba1 is no branch\n\n\ndef f(r):\n'
        '    return r.family == "quamba2-w4" or f"{ARCH}" == "Mamba-2"\n')
    (root / "recipes" / "quamba" / "_probe.py").write_text('FAMILY = "quamba1"\n')
    assert named_literals(root) == ["runner._probe:1 names 'mamba2'", "runner._probe:5 names 'quamba2-w4'"]
