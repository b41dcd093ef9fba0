"""The package's structure, read from its source alone (ast; nothing imported, no torch):
no import circles between modules, imports pointing down through the layers that
docs/README.md ("Code layout") states, and no function over :data:`MAX_FUNCTION_LINES` lines.

An import anywhere in a file counts, inside a function too; one under ``if TYPE_CHECKING:``
does not (it never runs). A string naming a module (a fork server's preload list, a
``python -m`` command line) is data, not an import.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

#: the package's parts, top layer first: a module imports from its own layer or a lower one.
#: ``__init__`` is the package's own (its public names); every other name is a module or
#: subpackage of ``distsync``. docs/README.md ("Code layout") states the same table.
LAYERS = (
    ("__init__", "cli", "worker"),
    ("experiments",),
    ("runtime", "sim", "options", "supervise"),
    ("solvers",),
    ("workloads", "sparse"),
    ("membership",),
    ("comm", "metrics"),
    ("config", "errors", "gate", "imports", "marks", "torch_private"),
)
MAX_FUNCTION_LINES = 80
#: the modules outside ``distsync.comm`` that import torch.distributed, each with what for
#: (docs/README.md says the same); the group operations themselves are comm/'s alone
TORCH_DISTRIBUTED_OUTSIDE_COMM = {
    "distsync.runtime.bind": "the launcher's TCPStore, the job's key-value store",
    "distsync.runtime.entry": "torchelastic's error record around a worker's entry point",
    "distsync.runtime.launch": "torchelastic's launcher, and its modules preloaded",
    "distsync.solvers.ddp": "torch's own DDP communication hooks",
    "distsync.solvers.peers": "torch's own averagers, the peers a comparison runs",
    "distsync.torch_private": "torch's private APIs, each behind a version check",
}


def modules(src: Path) -> dict[str, Path]:
    """Every module under ``src`` by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement may load (``from a import b``: ``a.b`` and ``a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names] + [base]


def import_graph(src: Path, top: str = "distsync") -> dict[str, dict[str, int]]:
    """Each module of package ``top`` under ``src``: the modules of ``top`` it imports, each
    with the line of its first import. Importing a module's own packages (which Python
    imports before it) is left out."""
    mods = modules(src)

    def owner(name: str) -> str | None:
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, dict[str, int]] = {}
    for me, path in mods.items():
        if me != top and not me.startswith(top + "."):
            continue
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        tree = _tree(path)
        skip = _type_checking_nodes(tree)
        deps: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for name in _imported_names(node, package):
                dep = owner(name)
                if dep and dep != me and not me.startswith(dep + ".") and dep != top:
                    deps[dep] = min(deps.get(dep, node.lineno), node.lineno)
        graph[me] = deps
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle of imports per strongly connected group of modules: its modules in import
    order, the first one again at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, group) for group in groups]


def _cycle_through(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest circle from the group's first module back to it, within the group."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in group and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {sorted(group)}")


def layer_of(module: str, layers=LAYERS, top: str = "distsync") -> int | None:
    """The index in ``layers`` of ``module``'s part of the package (None: in no layer)."""
    part = "__init__" if module == top else module.split(".")[1]
    return next((i for i, names in enumerate(layers) if part in names), None)


def upward_imports(graph: dict[str, dict[str, int]], src: Path, layers=LAYERS) -> list[str]:
    """Each import of a module from a higher layer, and each module in no layer, one line each."""
    problems = []
    mods = modules(src)
    for me in sorted(graph):
        mine = layer_of(me, layers)
        if mine is None:
            problems.append(f"{me}: in no layer of LAYERS (place it there and in docs/README.md's Code layout)")
            continue
        for dep, line in sorted(graph[me].items()):
            theirs = layer_of(dep, layers)
            if theirs is not None and theirs < mine:
                where = mods[me].relative_to(src)
                problems.append(f"{where}:{line}: {me} (layer {', '.join(layers[mine])}) imports {dep}, "
                                f"a layer above (layer {', '.join(layers[theirs])})")
    return problems


def long_functions(src: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method over ``limit`` lines (from its ``def`` to its last line), as
    ``file:qualified.name (N lines)``."""
    found = []

    def visit(node: ast.AST, path: Path, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(src)}:{name} ({lines} lines)")
                visit(child, path, name + ".")
            else:
                visit(child, path, prefix)

    for path in sorted(src.rglob("*.py")):
        visit(_tree(path), path, "")
    return found


def documented_layers(readme: Path) -> tuple[tuple[str, ...], ...]:
    """The layer table as docs/README.md's Code layout states it: the first paragraph there
    with arrows, each layer's names in backquotes, layers split by ``->``."""
    text = readme.read_text().split("## Code layout", 1)[1]
    paragraph = next(p for p in text.split("\n\n") if "->" in p)
    return tuple(tuple(re.findall(r"`([^`]+)`", part)) for part in paragraph.split("->"))


# --- the package -----------------------------------------------------------------------------


def _circle_text(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    """A circle, and every module that goes in circles with it when there are more."""
    group = _group_of(graph, circle[0])
    more = f"\n  ({len(group)} modules in circles with each other: {', '.join(sorted(group))})" \
        if len(group) > len(circle) - 1 else ""
    return " -> ".join(circle) + more


def _group_of(graph: dict[str, dict[str, int]], module: str) -> set[str]:
    """The modules that import ``module`` (through others) and that it imports."""
    def reach(start: str, edges) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges(todo.pop()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    importers: dict[str, set[str]] = {}
    for v, deps in graph.items():
        for w in deps:
            importers.setdefault(w, set()).add(v)
    return reach(module, lambda v: graph.get(v, ())) & reach(module, lambda v: importers.get(v, ()))


def test_no_import_circles():
    graph = import_graph(SRC)
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(_circle_text(graph, c) for c in found)


def test_imports_point_down_the_layers():
    problems = upward_imports(import_graph(SRC), SRC)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_no_function_is_over_80_lines():
    found = long_functions(SRC)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def torch_distributed_importers(src: Path) -> set[str]:
    """The modules of ``distsync`` outside ``distsync.comm`` that import torch.distributed
    (or a module under it)."""
    out = set()
    for me, path in modules(src).items():
        if me == "distsync.comm" or me.startswith("distsync.comm."):
            continue
        tree = _tree(path)
        skip = _type_checking_nodes(tree)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        if any(n == "torch.distributed" or n.startswith("torch.distributed.")
               for node in ast.walk(tree) if id(node) not in skip for n in _imported_names(node, package)):
            out.add(me)
    return out


def test_torch_distributed_is_imported_outside_comm_only_where_declared():
    assert torch_distributed_importers(SRC) == set(TORCH_DISTRIBUTED_OUTSIDE_COMM)
    readme = (ROOT / "docs" / "README.md").read_text()
    for module in TORCH_DISTRIBUTED_OUTSIDE_COMM:
        path = module.removeprefix("distsync.").replace(".", "/") + ".py"
        assert path in readme, f"docs/README.md does not say that {path} imports torch.distributed"


def test_the_readme_states_the_same_layers():
    assert documented_layers(ROOT / "docs" / "README.md") == LAYERS


# --- the checks themselves find what they look for -------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"distsync/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_circle_through_a_function_local_import_is_found(tmp_path):
    src = _package(tmp_path, {
        "distsync/workloads/__init__.py": "",
        "distsync/workloads/base.py": "from distsync.workloads import batches\n",
        "distsync/workloads/batches.py": "def f():\n    from distsync.workloads.base import X\n",
        "distsync/config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from distsync import cli\n",
        "distsync/cli.py": "import distsync.config\n",
    })
    assert circles(import_graph(src)) == [["distsync.workloads.base", "distsync.workloads.batches",
                                           "distsync.workloads.base"]]


def test_an_upward_import_and_a_module_in_no_layer_are_found(tmp_path):
    src = _package(tmp_path, {
        "distsync/runtime/__init__.py": "",
        "distsync/runtime/forkserver.py": "PRELOAD = ('distsync.worker',)\n\n\ndef run():\n"
                                          "    from distsync import worker\n",
        "distsync/worker.py": "from distsync.runtime import forkserver\n",
        "distsync/elsewhere.py": "",
    })
    assert upward_imports(import_graph(src), src) == [
        "distsync.elsewhere: in no layer of LAYERS (place it there and in docs/README.md's Code layout)",
        "distsync/runtime/forkserver.py:5: distsync.runtime.forkserver (layer runtime, sim, options, supervise) "
        "imports distsync.worker, a layer above (layer __init__, cli, worker)",
    ]


def test_an_import_of_torch_distributed_outside_comm_is_found(tmp_path):
    src = _package(tmp_path, {
        "distsync/comm/__init__.py": "import torch.distributed as dist\n",
        "distsync/solvers/__init__.py": "",
        "distsync/solvers/x.py": "def f():\n    from torch.distributed.optim import ZeroRedundancyOptimizer\n",
        "distsync/solvers/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.distributed\n",
        "distsync/solvers/z.py": "import torch.nn\nNAME = 'torch.distributed'\n",
    })
    assert torch_distributed_importers(src) == {"distsync.solvers.x"}


def test_a_long_function_is_found_with_its_file_and_length(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    src = _package(tmp_path, {"distsync/sim/train.py": f"class A:\n    def ok(self):\n        pass\n\n\n"
                                                        f"def simulate(a):\n{body}"})
    assert long_functions(src) == ["distsync/sim/train.py:simulate (81 lines)"]
    assert long_functions(src, limit=81) == []
