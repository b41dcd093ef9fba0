"""What-if: a ``sitecustomize`` that simulates start-up cuts in a distsync run without
touching src/, to check estimated savings (``benchmarks/startup.py --what-if CUTS``).

    STARTUP_WHATIF=sklearn,exit PYTHONPATH=benchmarks/startup_profile/whatif:$PYTHONPATH distsync train ...

Cuts (comma-separated in ``STARTUP_WHATIF``; without it, importing this module does nothing):

- ``sklearn``: distsync.workloads.digits loads sklearn's digits.csv.gz with numpy and splits
  with numpy (a stratified split, not sklearn's exact one): no sklearn/scipy/pandas import, in
  the launcher and in every worker (not applied, with a line on stderr, once digits.py no
  longer imports those two names)
- ``matplotlib``: stand-in matplotlib modules: the summary table's import of
  distsync.experiments costs no matplotlib (a train run draws no plots)
- ``exit``: the launcher leaves with os._exit after main() returns: no interpreter finalization
- ``dynamo``: a stand-in torch._dynamo (graph_break, disable): torch.optim's first call does
  not import the real one
"""

import os as _os
_CUTS = set(filter(None, _os.environ.get("STARTUP_WHATIF", "").split(",")))
if _CUTS:
    import sys as _sys, types as _types
    if "dynamo" in _CUTS:
        _stub = _types.ModuleType("torch._dynamo")
        _stub.graph_break = lambda: None
        def _disable(fn=None, recursive=True, wrapping=True, reason=None):
            return fn if fn is not None else (lambda f: f)
        _stub.disable = _disable
        _stub.is_compiling = lambda: False
        _stub.trace_rules = _types.SimpleNamespace(clear_lru_cache=lambda: None)  # init_process_group calls it
        _sys.modules["torch._dynamo"] = _stub
    if "matplotlib" in _CUTS:
        for _n in ("matplotlib", "matplotlib.pyplot"):
            _m = _types.ModuleType(_n)
            _m.use = lambda *a, **k: None
            _sys.modules[_n] = _m
        _sys.modules["matplotlib"].pyplot = _sys.modules["matplotlib.pyplot"]
    _PRELUDE = (
        "import numpy as _np\n"
        "def load_digits(return_X_y=True):\n"
        "    import importlib.util, os\n"
        "    d = os.path.join(importlib.util.find_spec('sklearn').submodule_search_locations[0], 'datasets', 'data')\n"
        "    a = _np.loadtxt(os.path.join(d, 'digits.csv.gz'), delimiter=',')\n"
        "    return a[:, :-1], a[:, -1].astype(_np.int64)\n"
        "def train_test_split(x, y, test_size=0.2, random_state=0, stratify=None):\n"
        "    rng = _np.random.RandomState(random_state)\n"
        "    ev = _np.sort(_np.concatenate([rng.permutation(_np.flatnonzero(y == c))\n"
        "                                   [:int(round(test_size * (y == c).sum()))]\n"
        "                                  for c in _np.unique(y)]))\n"
        "    tr = _np.setdiff1d(_np.arange(len(y)), ev)\n"
        "    return x[tr], x[ev], y[tr], y[ev]\n")

    class _WhatIf:
        def find_spec(self, name, path=None, target=None):
            if not ((name == "distsync.workloads.digits" and "sklearn" in _CUTS)
                    or (name == "distsync.cli" and "exit" in _CUTS)):
                return None
            spec = None
            for finder in _sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            if spec is None or spec.loader is None:
                return spec
            inner = spec.loader.exec_module
            if name == "distsync.workloads.digits":
                def exec_module(module, _origin=spec.origin):
                    src = open(_origin).read()
                    lines = ("from sklearn.datasets import load_digits\n",
                             "from sklearn.model_selection import train_test_split\n")
                    new = src.replace(lines[0], "").replace(lines[1], _PRELUDE)
                    if not all(line in src for line in lines):
                        _sys.stderr.write("what-if: digits.py changed; the sklearn cut is not applied\n")
                        return inner(module)
                    exec(compile(new, _origin, "exec"), module.__dict__)
            else:
                def exec_module(module):
                    inner(module)
                    real = module.main

                    def main(argv=None):
                        code = real(argv)
                        if argv is None:  # the console script: leave without finalization
                            _sys.stdout.flush()
                            _sys.stderr.flush()
                            _os._exit(code if isinstance(code, int) else 0)
                        return code
                    module.main = main
            spec.loader.exec_module = exec_module
            return spec

    _sys.meta_path.insert(0, _WhatIf())
