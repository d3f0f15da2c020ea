"""The package layout's rules, read from the source: imports point one way and no two modules import each other.

    swarm.net  <-  swarm/*.py (spec, blocks, gguf, ...)  <-  swarm.client, peers  <-  swarm.ops  <-  swarm.testing

A layer is a package (a folder: its modules and its subfolders'), or ``TOP``: the modules at swarm/'s own level, which
are no package of their own. Every import counts, also those inside functions and under ``TYPE_CHECKING``: a lazy
import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACADE, COMMAND = "swarm", "swarm.__main__"  # swarm/__init__.py and swarm/__main__.py, each a layer of its own
TOP = "swarm/*.py"  # the model folder and one block, which both sides use
PACKAGES = ("swarm.net", "swarm.client", "swarm.ops", "swarm.testing", "peers")  # the folders
LAYERS = {  # layer -> the layers it may import (itself included)
    "swarm.net": {"swarm.net"},
    TOP: {"swarm.net", TOP},
    "swarm.client": {"swarm.net", TOP, "swarm.client"},
    "peers": {"swarm.net", TOP, "peers"},
    "swarm.ops": {"swarm.net", TOP, "swarm.client", "peers", "swarm.ops"},
    "swarm.testing": {"swarm.net", TOP, "swarm.client", "peers", "swarm.ops", "swarm.testing"},
    # the facade: the errors at once, the client's names on first use
    FACADE: {"swarm.net", TOP, "swarm.client"},
    COMMAND: {"swarm.ops"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module in (FACADE, COMMAND):
        return module
    for package in PACKAGES:
        if module == package or module.startswith(package + "."):
            return package
    return TOP  # swarm.spec, swarm.blocks, swarm.gguf, ...


def our_modules() -> dict[str, Path]:
    files = [*(ROOT / "swarm").rglob("*.py"), *(ROOT / "peers").rglob("*.py")]
    return {module_name(path): path for path in files}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of ours that ``path`` imports (``from pkg import mod`` names the module when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if target != FACADE and layer_of(target) not in LAYERS[layer_of(module)]
    )


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk, as the cycle it closes."""
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":  # on the stack: path + [module]
                cycles.append(" -> ".join([*path[path.index(target) :], module, target]))
            elif target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return cycles


def test_the_layers_are_the_trees_folders_and_swarms_own_modules():
    """Every layer but ``TOP`` and the two entry points is a folder of the tree, and every folder of modules is in
    one (its top folder: peers/ or one below swarm/); ``TOP`` holds only files at swarm/'s own level. So no layer is a
    package that does not exist, and a new folder cannot fall into ``TOP`` unnoticed."""
    modules = our_modules()
    folders = {path.parent.relative_to(ROOT).parts for path in modules.values()} - {("swarm",)}
    assert {".".join(folder[: 1 if folder[0] == "peers" else 2]) for folder in folders} == set(PACKAGES)
    assert set(LAYERS) == {*PACKAGES, TOP, FACADE, COMMAND}
    top = {name: path for name, path in modules.items() if layer_of(name) == TOP}
    assert "swarm.spec" in top and all(path.parent == ROOT / "swarm" for path in top.values()), top


def test_every_import_points_down_the_layers():
    wrong = forbidden_arrows(import_graph())
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_no_module_of_the_net_layer_or_the_peers_imports_the_facade():
    """``import swarm`` from a peer would be harmless today (the facade is lazy) but is an arrow up all the same."""
    graph = import_graph()
    wrong = [m for m, targets in graph.items() if FACADE in targets and layer_of(m) in ("swarm.net", "peers")]
    assert wrong == []


def test_there_is_no_import_cycle():
    graph = {module: {t for t in targets if t != FACADE} for module, targets in import_graph().items()}
    cycles = find_cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_a_forbidden_arrow_and_a_cycle(tmp_path):
    """The checks above can fail: an arrow up from the net layer, a peer importing the harness, a three-module
    cycle, each in a hand-made graph; and a lazy import inside a function is read as an arrow."""
    (tmp_path / "a.py").write_text("def f():\n    from swarm.client import model\nimport swarm.net.wire\n")
    assert imports_of(tmp_path / "a.py", {"swarm.client", "swarm.client.model", "swarm.net.wire"}) == {
        "swarm.client",
        "swarm.client.model",
        "swarm.net.wire",
    }
    graph = {"swarm.net.records": {"swarm.client.model"}, "peers.daemon": {"swarm.testing.chaos"}}
    assert forbidden_arrows(graph) == ["peers.daemon -> swarm.testing.chaos", "swarm.net.records -> swarm.client.model"]
    cycle = {"swarm.net.a": {"swarm.net.b"}, "swarm.net.b": {"swarm.net.c"}, "swarm.net.c": {"swarm.net.a"}}
    assert find_cycles(cycle) == ["swarm.net.a -> swarm.net.b -> swarm.net.c -> swarm.net.a"]
    assert find_cycles({"swarm.net.a": {"swarm.net.b"}, "swarm.net.b": set()}) == []


def test_tests_and_scripts_take_the_harness_from_swarm_testing_not_from_scripts():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("tests", "scripts")
        for path in (ROOT / folder).rglob("*.py")
        if path != Path(__file__) and "spec_from_file_location" in path.read_text()
    ]
    assert offenders == []
