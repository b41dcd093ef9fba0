"""Start-up tracer: imported as ``sitecustomize`` by every Python process of a traced job.

    STARTUP_TRACE=trace.jsonl PYTHONPATH=benchmarks/startup_profile/tracer:$PYTHONPATH distsync train ...

With ``STARTUP_TRACE`` set (children inherit it and the ``PYTHONPATH``), each process appends
one JSON line per event to that file, with its unix time and CPU time: ``site`` (the
interpreter is up), ``import`` spans of the modules in ``_SPANS``, ``call`` for each call of
the functions in ``_PATCH`` (wrapped when their module is first executed; nothing under src/
is changed), ``os_exit`` and ``atexit``: the points ``benchmarks/startup.py`` marks phases by.
Without it, importing this module does nothing. ``benchmarks/startup.py --breakdown`` runs
a job under it and analyses the trace.
"""

import os
_PATH = os.environ.get("STARTUP_TRACE")
if _PATH:
    import sys, time, json, atexit, functools
    _fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _emit(ev, **kw):
        rec = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "ev": ev,
               "t": time.time(), "cpu": time.process_time()}
        rec.update(kw)
        os.write(_fd, (json.dumps(rec) + "\n").encode())

    _emit("site")

    # Import spans (inclusive: a package's imports of others count in it too).
    _SPANS = {"distsync.workloads.digits"}
    # Functions timed on every call, wrapped when their module has been executed.
    _PATCH = {
        "distsync.cli": ["main", "_cmd_train"],
        "distsync.workloads": ["load_workload"],
        "distsync.runtime.launch": ["launch"],
        "distsync.runtime.process": ["run_process", "recovery_for", "write_results"],
        "distsync.runtime.loop": ["train_worker", "make_optimizer"],
        "distsync.comm.comm": ["Comm.from_env", "Comm.close", "Comm.barrier", "Comm.gather_object"],
        "torch.distributed.distributed_c10d": ["init_process_group", "destroy_process_group", "all_reduce"],
        "torch.distributed.run": ["main"],
        "torch.distributed.launcher.api": ["launch_agent"],
        "torch.distributed.elastic.agent.server.api": ["SimpleElasticAgent._rendezvous",
                                                       "SimpleElasticAgent._exit_barrier"],
        "torch.distributed.elastic.agent.server.local_elastic_agent": ["LocalElasticAgent._start_workers",
                                                                       "LocalElasticAgent._shutdown",
                                                                       "LocalElasticAgent._monitor_workers"],
    }

    def _wrap(label, fn):
        quiet = label.endswith("_monitor_workers")  # polled every monitor_interval: only the verdict

        @functools.wraps(fn)
        def traced(*a, **k):
            t0, c0 = time.time(), time.process_time()
            try:
                out = fn(*a, **k)
            except BaseException as e:
                _emit("call", fn=label, t0=t0, cpu0=c0, raised=type(e).__name__)
                raise
            if quiet:
                state = getattr(getattr(out, "state", None), "name", "")
                if state == "HEALTHY":
                    return out
                _emit("call", fn=label, t0=t0, cpu0=c0, state=state)
            else:
                _emit("call", fn=label, t0=t0, cpu0=c0)
            return out
        return traced

    def _patch(modname, module):
        for path in _PATCH.get(modname, ()):
            try:
                owner, _, name = path.rpartition(".")
                holder = getattr(module, owner) if owner else module
                raw = holder.__dict__[name] if owner else getattr(module, name)
                label = modname.rsplit(".", 1)[-1] + "." + path
                if isinstance(raw, classmethod):
                    new = classmethod(_wrap(label, raw.__func__))
                elif isinstance(raw, staticmethod):
                    new = staticmethod(_wrap(label, raw.__func__))
                else:
                    new = _wrap(label, raw)
                setattr(holder, name, new)
            except Exception as e:  # the code moved: the phase is missing, the run goes on
                _emit("patch-failed", fn=modname + "." + path, error=repr(e))

    _busy = set()

    class _Finder:
        def find_spec(self, name, path=None, target=None):
            if (name not in _SPANS and name not in _PATCH) or name in _busy:
                return None
            _busy.add(name)
            try:
                spec = None
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        break
            finally:
                _busy.discard(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            inner = spec.loader.exec_module

            def exec_module(module, _inner=inner, _name=name):
                t0, c0 = time.time(), time.process_time()
                try:
                    _inner(module)
                finally:
                    if _name in _SPANS:
                        _emit("import", mod=_name, t0=t0, cpu0=c0)
                _patch(_name, module)
            try:
                spec.loader.exec_module = exec_module
            except Exception:
                pass
            return spec

    sys.meta_path.insert(0, _Finder())

    _real_exit = os._exit

    def _exit(code, _real=_real_exit):
        _emit("os_exit", code=code)
        _real(code)
    os._exit = _exit
    atexit.register(lambda: _emit("atexit"))
