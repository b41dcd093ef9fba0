import dataclasses

import pytest
import torch
import torch.nn as nn

from distsync.errors import ConfigError
from distsync.solvers import Solver, make_options, make_solver, solver_class, solver_names


def test_registry_lists_shipped_solvers_and_converts_options():
    assert {"allreduce", "ddp"} <= set(solver_names())
    s = make_solver("allreduce", bucket_mb="0.5", overlap="false")
    assert s.options.bucket_mb == 0.5 and s.options.overlap is False
    with pytest.raises(ConfigError, match="option overlap='maybe' is not a valid bool"):
        make_solver("allreduce", overlap="maybe")
    with pytest.raises(ConfigError, match="unknown solver 'x'; valid: "):
        solver_class("x")


def test_solver_step_context_runs_hooks_in_order():
    calls = []

    class Recorder(Solver):
        name = "recorder"

        def before_step(self, step):
            calls.append(("before", step))

        def after_backward(self, step):
            calls.append(("after_backward", step, self.model.weight.grad is not None))

        def update(self, step):
            calls.append(("update", step))
            super().update(step)

        def after_update(self, step):
            calls.append(("after_update", step))

    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    s = Recorder()
    s.attach(model, opt, comm=None)
    with s.step(0):
        calls.append(("body", 0))
        model(torch.tensor([[1.0, 2.0]])).sum().backward()
    assert calls == [("before", 0), ("body", 0), ("after_backward", 0, True), ("update", 0), ("after_update", 0)]
    # w <- w - 0.5 * x
    assert model.weight.tolist() == [[0.5, 0.0]]
    assert model.weight.grad is None  # zero_grad ran


def test_options_dataclass_defaults_are_listed():
    fields = {f.name: f.default for f in dataclasses.fields(solver_class("allreduce").Options)}
    assert fields == {"bucket_mb": 25.0, "overlap": True, "compress": "none", "powersgd_rank": 1, "warm_start": True,
                      "error_feedback": True, "powersgd_start": 0, "seed": 0, "next_forward": True,
                      "during_backward_mb": None}
    assert make_options(solver_class("ddp"), {}).bucket_mb == 25.0


def test_compare_options_name_solvers_given_by_path():
    from distsync.experiments.compare import split_solver_options

    path = "tests/fixtures/probe_solver.py:ServerProbe"
    per = split_solver_options(["allreduce", path], {f"{path}.servers": "2", "allreduce.bucket_mb": "1"})
    assert per == {"allreduce": {"bucket_mb": "1"}, path: {"servers": "2"}}
    with pytest.raises(ConfigError, match="option ddp.bucket_mb: ddp is not among the compared solvers"):
        split_solver_options(["allreduce", path], {"ddp.bucket_mb": "1"})


def test_the_solver_class_keeps_the_training_hooks_and_the_own_loop_entry_only():
    """The Solver is narrow (at most 15 methods of its own); what other rooms ask lives in
    theirs (the plan, the role protocols, the buffers, the own-loop adapter)."""
    own = [n for n, v in vars(Solver).items() if callable(v) or isinstance(v, (classmethod, staticmethod, property))]
    methods = sorted(n for n in own if not (n.startswith("__") and n.endswith("__")) and n not in ("Options", "Plan"))
    assert len(methods) <= 15, methods
    assert {"attach", "after_backward", "update", "after_update", "step", "no_sync", "final_model"} <= set(methods)


def test_a_solvers_plan_is_its_own_composed_with_its_parents_and_knows_its_solver():
    class Base(Solver):
        name = "plan-base"

        class Plan:
            @classmethod
            def lockstep_lead(cls, options, workers):
                return 2 * workers

            @classmethod
            def extra_roles(cls, options):
                return {"server": 1}

    class Child(Base):
        name = "plan-child"

        class Plan:
            @classmethod
            def extra_roles(cls, options):
                return {"server": 3}

    class Grandchild(Child):  # (no plan of its own: its parent's, under its own name)
        name = "plan-grandchild"

    assert Child.Plan.lockstep_lead(None, 4) == 8  # inherited from Base's plan
    assert Child.Plan.extra_roles(None) == {"server": 3} and Base.Plan.extra_roles(None) == {"server": 1}
    assert Child.Plan.search_space(4) == [{}]  # the defaults under both
    assert (Grandchild.Plan.name, Grandchild.Plan.solver) == ("plan-grandchild", Grandchild)
    assert Grandchild.Plan.extra_roles(None) == {"server": 3} and Grandchild().roles == {"server": 3}
    assert solver_class("hogwild").Plan.training_threads(make_options(solver_class("hogwild"), {"threads": 3})) == 3
    assert make_solver("hogwild", threads=3).threads == 3 and make_solver("async-ps", servers=2).roles == {"server": 2}


@pytest.mark.parametrize("body, message", [
    ({"simulate_timing": classmethod(lambda cls, o, sim: None)},
     "solver old defines simulate_timing on the class: list it in the class's nested `class Plan:`"),
    ({"begin_step": lambda self, step: None}, "solver old defines begin_step, which nothing reads: the step's start"),
    ({"synchronize": lambda self: None}, "solver old defines synchronize, which nothing reads: a user's block"),
    ({"roles": property(lambda self: {"server": 1})},
     "solver old defines roles, which nothing reads: declare the classmethod extra_roles(cls, options) in"),
    ({"capabilities": Solver.capabilities | {__import__("distsync").solvers.Capability.HEALS_BY_CHANNELS}},
     "solver old declares Capability.HEALS_BY_CHANNELS but does not define channel_peers, abandon_channel, "
     "join_peers"),
])
def test_a_solver_class_written_for_the_old_wide_interface_is_refused_where_it_is_made(body, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        type("Old", (Solver,), {"name": "old", **body})


def test_block_synchronize_runs_the_solvers_synchronization_once_inside_the_block_only():
    calls = []

    class Late(Solver):  # (synchronizes just before the update, as the servers' and averaging solvers do)
        name = "late-sync"

        def after_backward(self, step):
            calls.append(("sync", step, float(self.model.weight.grad.sum())))

    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Late()
    s.attach(model, opt, comm=None)
    with s.step(3) as block:
        model(torch.tensor([[1.0, 2.0]])).sum().backward()
        assert calls == []
        block.synchronize()
        assert calls == [("sync", 3, 3.0)]
        block.synchronize()  # (again: nothing)
        opt.step()  # (the user's step: no second synchronization)
    assert calls == [("sync", 3, 3.0)]
    with s.step(4):
        model(torch.tensor([[1.0, 1.0]])).sum().backward()
    assert calls == [("sync", 3, 3.0), ("sync", 4, 2.0)]  # (without it: once, at the block's end)
    with pytest.raises(ConfigError, match=r"block\.synchronize\(\) belongs inside its `with solver\.step\(i\) as block:`"):
        block.synchronize()


@pytest.mark.parametrize("solver, options, want", [
    ("sync-ps", {}, 12),  # one update a round
    ("async-ps", {"n_push": 3}, 10 // 3 + 7 // 3),  # a push every n_push steps of each worker
    ("hogwild", {}, 10 + 7),
    ("async-easgd", {"tau": 2}, 10 // 2 + 7 // 2),  # an exchange every tau steps
    ("shadow-ea", {}, None),  # (its exchanges follow time)
    ("allreduce", {}, None),  # (no servers)
])
def test_a_plan_says_how_many_updates_its_servers_apply_for_the_workers_steps(solver, options, want):
    cls = solver_class(solver)
    assert cls.Plan.server_updates(make_options(cls, options), [10, 7], 12) == want


def test_a_closed_solver_takes_its_own_loop_hooks_off_and_a_second_attach_is_refused():
    """One optimizer, a second solver after the first is closed: only the live solver's hooks
    act (a left-over one would take the user's optimizer.step() in the new block for a second
    step between the old one's blocks). A closed solver's step() and a second attach are
    refused; after close the optimizer is the user's alone."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.tensor([[1.0, 2.0]])

    def one_step(solver, i):
        with solver.step(i):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

    first = make_solver("local")
    first.attach(model, opt, comm=None)
    one_step(first, 0)
    with pytest.raises(ConfigError, match=r"solver local is attached already \(a solver serves one model and "):
        first.attach(model, opt, comm=None)
    one_step(first, 1)
    first.close()
    with pytest.raises(ConfigError, match=r"solver local is closed: solver\.step\(\) after close\(\)"):
        first.step(2)
    second = make_solver("ma", every=2)
    second.attach(model, opt, comm=None)
    one_step(second, 2)
    second.close()
    model(x).sum().backward()
    opt.step()  # (the user's own, after every solver is closed: nothing refuses it)
    assert model.weight.flatten().tolist() == pytest.approx([-0.4, -0.8])  # four steps of -0.1 x, each once


def test_takes_option_reads_the_solvers_options():
    from distsync.solvers import takes_option

    assert takes_option("ma", "every") and takes_option("async-ps", "servers")
    assert not takes_option("allreduce", "every") and not takes_option("sync-easgd", "servers")
