"""Docs that cannot drift silently: every code name quoted in docs/, the README and the
package's docstrings exists.

A quoted span counts as a code name when it reads as one: a dotted chain of identifiers
(``a.b.c``, optionally called: ``f()``) with an underscore, a dot, a call or an inner
capital (a one-word ``Solver`` or ``step`` is prose's as much as code's). It exists when:

- it is a file name (``summary.json``): some file of the repository has that name, or the
  code spells it;
- it starts at a module outside the project (``torch.``, ``dist.``, ``nn.``, ``np.``...):
  importing and walking it finds it;
- it starts with ``distsync.``: importing and walking it finds it;
- otherwise each of its parts is defined in the project's code (a module, class, function,
  argument, assigned or keyword name, or a string the code uses as a name), is a builtin,
  or is one of :data:`EXTERNAL`: names of other projects', each with where it lives (checked
  by import where the project is installed).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.jit's, on import)

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("src", "benchmarks", "tests", "tools")
FILE_EXTS = ("json", "jsonl", "csv", "md", "toml", "txt", "yaml", "py", "log", "pt", "html", "png", "svg", "sh")
#: a quoted name's first part -> the module it stands for
ROOTS = {"torch": "torch", "dist": "torch.distributed", "nn": "torch.nn", "F": "torch.nn.functional",
         "np": "numpy", "numpy": "numpy", "sklearn": "sklearn", "copy": "copy", "random": "random",
         "math": "math", "os": "os", "threading": "threading", "json": "json", "signal": "signal",
         "subprocess": "subprocess", "multiprocessing": "multiprocessing", "time": "time", "sys": "sys",
         "gc": "gc", "tomllib": "tomllib"}
#: names of other projects that the docs quote unqualified: name -> the module whose attribute
#: (walked by the name's parts) it is; for an attribute of an instance, "module.Class()"
EXTERNAL = {
    "DataLoader": "torch.utils.data",
    "ProcessGroup": "torch.distributed",
    "distributed_c10d": "torch.distributed",
    "c10d_rendezvous_backend": "torch.distributed.elastic.rendezvous",
    "DistributedSampler": "torch.utils.data",
    "IterableDataset": "torch.utils.data",
    "GradScaler": "torch.amp",
    "functional_call": "torch.func",
    "batch_isend_irecv": "torch.distributed",
    "compare_set": "torch.distributed.Store",
    "shrink_group": "torch.distributed",
    "split_group": "torch.distributed",
    "LaunchConfig": "torch.distributed.launcher.api",
    "start_processes": "torch.distributed.elastic.multiprocessing",
    "DynamicRendezvousHandler": "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "last_call": "torch.distributed.elastic.rendezvous.dynamic_rendezvous.RendezvousTimeout()",
    "SimpleElasticAgent": "torch.distributed.elastic.agent.server.api",
    "_start_workers": "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent",
    "PeriodicModelAverager": "torch.distributed.algorithms.model_averaging.averagers",
    "PostLocalSGDOptimizer": "torch.distributed.optim",
    "allreduce_hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "fp16_compress_hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "bf16_compress_hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "powerSGD_hook": "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "running_mean": "torch.nn.BatchNorm1d(1)",
    "running_var": "torch.nn.BatchNorm1d(1)",
    "num_batches_tracked": "torch.nn.BatchNorm1d(1)",
    "DecentralizedAverager": "hivemind.averaging",
    "SuccessiveHalvingPruner": "optuna.pruners",
}
#: names that stand for an instance of another project's class: name -> the class
INSTANCES = {"param": "torch.nn.Parameter"}
#: environment variables that torch reads, quoted where the docs say what they do
TORCH_ENV = {"TORCHELASTIC_USE_AGENT_STORE"}
#: quoted spans that name nothing in the code by design: span -> what it stands for
NOT_NAMES = {
    "SOLVER.KEY": "an option's form on the command line (-o SOLVER.KEY=VALUE)",
    "path_to_file_make": "a run folder's name made from a workload's path (path/to/file.py:make)",
    "recommend_nominal_link.json": "a raw file removed with the code that made it (its page says so)",
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?")
_QUOTED = re.compile(r"`([^`\n]+)`")


def _code_files() -> list[Path]:
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))
            if ".egg-info" not in str(p) and p != Path(__file__).resolve()]  # (this file names what is not)


@functools.lru_cache(maxsize=None)
def project_names() -> tuple[frozenset[str], frozenset[str]]:
    """(every name the project's code defines or uses as a name, every string it holds)."""
    names: set[str] = set()
    strings: set[str] = set()
    for path in _code_files():
        names.add(path.stem)
        names.update(part.name for part in path.relative_to(ROOT).parents)
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.keyword) and n.arg:
                names.add(n.arg)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                strings.add(n.value)
                if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n.value):
                    names.add(n.value)
    strings.update((ROOT / "Makefile").read_text().split())
    return frozenset(names), frozenset(strings)


def texts() -> list[tuple[str, str]]:
    """(where, text): the docs' pages, the README, and every docstring of the package."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "docs").rglob("*.md"))]
    out.append(("README.md", (ROOT / "README.md").read_text()))
    for path in sorted((ROOT / "src" / "distsync").rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(n)
                if doc:
                    where = f"{path.relative_to(ROOT)}" + (f" ({n.name})" if hasattr(n, "name") else "")
                    out.append((where, doc))
    return out


def quoted_names(text: str) -> list[str]:
    """The spans of ``text`` quoted in backticks that read as code names."""
    out = []
    for span in _QUOTED.findall(text):
        span = span.strip()
        if not _NAME.fullmatch(span):
            continue
        name = span.removesuffix("()")
        if "_" in name or "." in name or span.endswith("()") or re.search(r"[a-z][A-Z]", name):
            out.append(span)
    return out


def _walk(obj: object, parts: list[str]) -> bool:
    for part in parts:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _module_walk(dotted: str, parts: list[str]) -> bool:
    """Whether ``dotted`` (a module, a module's attribute, or ``module.Class(args)``: an instance)
    has the attribute chain ``parts``. A project that is not installed is taken at its word."""
    call = re.fullmatch(r"(.*)\((.*)\)", dotted)
    dotted, args = (call[1], ast.literal_eval(f"({call[2]},)") if call[2] else ()) if call else (dotted, None)
    bits = dotted.split(".") + (list(parts) if args is None else [])
    parts = parts if args is not None else []
    for cut in range(len(bits), 0, -1):
        try:
            obj = importlib.import_module(".".join(bits[:cut]))
        except ModuleNotFoundError as e:
            if e.name == bits[0]:
                return True  # (an optional project, not installed here)
            continue
        if not _walk(obj, bits[cut:]):
            return False
        for part in bits[cut:]:
            obj = getattr(obj, part)
        return _walk(obj if args is None else obj(*args), parts)
    return False


def missing(span: str) -> str | None:
    """Why ``span`` names nothing, or None if it names something."""
    name = span.removesuffix("()")
    parts = name.split(".")
    names, strings = project_names()
    if span in NOT_NAMES or name in TORCH_ENV:
        return None
    if parts[-1] in FILE_EXTS and len(parts) == 2:
        found = any(ROOT.glob(f"**/{name}")) or any(name in s for s in strings)
        return None if found else "no file has this name and no code spells it"
    if parts[0] in ROOTS:
        where = ".".join([ROOTS[parts[0]], *parts[1:]])
        return None if _module_walk(where, []) else f"not found in {ROOTS[parts[0]]}"
    if parts[0] == "distsync":
        return None if _module_walk(name, []) else "not found in the package"
    if parts[0] in INSTANCES:
        return None if _module_walk(INSTANCES[parts[0]], parts[1:]) else f"not found in {INSTANCES[parts[0]]}"
    if parts[0] in EXTERNAL:
        return None if _module_walk(EXTERNAL[parts[0]], parts) else f"not found in {EXTERNAL[parts[0]]}"
    unknown = [p for p in parts if p not in names and not hasattr(builtins, p)]
    return f"{', '.join(unknown)}: defined nowhere in the code" if unknown else None


def test_every_code_name_quoted_in_the_docs_exists():
    found = [f"{where}: `{span}`: {why}" for where, text in texts() for span in dict.fromkeys(quoted_names(text))
             if (why := missing(span))]
    assert not found, "names quoted in the docs that the code does not have:\n" + "\n".join(found)


def test_the_external_names_are_where_they_are_said_to_be():
    wrong = [f"{name}: not in {where}" for name, where in EXTERNAL.items()
             if not _module_walk(where, name.split("."))]
    assert not wrong, "\n".join(wrong)


# --- the check finds what it looks for ------------------------------------------------------


def test_a_name_that_does_not_exist_is_found():
    assert quoted_names("the `SmartSchedule` and `policy_for()`; a `Solver` and `step`, `-o KEY=V`") == \
        ["SmartSchedule", "policy_for()"]
    assert missing("SmartSchedule") == "SmartSchedule: defined nowhere in the code"
    assert missing("policy_for()") == "policy_for: defined nowhere in the code"
    assert missing("ReadyGrouper") is None and missing("failure_policy()") is None
    assert missing("distsync.solvers.base.Solver") is None
    assert missing("distsync.solvers.base.NoSuchSolver") == "not found in the package"
    assert missing("dist.all_reduce") is None and missing("dist.all_reduce_fast") == "not found in torch.distributed"
    assert missing("summary.json") is None and missing("never_written.json") is not None
    assert missing("DataLoader.__iter__") is None and missing("DataLoader.no_such") is not None
    assert missing("running_mean") is None and missing("running_median") is not None


@pytest.mark.parametrize("where", ["torch.nn.BatchNorm1d(1)", "torch.utils.data"])
def test_an_external_name_is_checked_where_it_is_said_to_live(where):
    assert not _module_walk(where, ["no_such_name"])
