"""Run options typed to the end: text (command line, config file, Python) becomes a value where
a config is made, config.json keeps the text, and nothing below the edge parses it again."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from distsync.config import Budget, Cadence, Fault, Link, RunConfig, parse_link
from distsync.errors import ConfigError

SRC = Path(__file__).resolve().parent.parent / "src" / "distsync"
#: the functions that read a run option's text
PARSERS = {"parse_link", "parse_budget", "parse_fault", "parse_slow", "checkpoint_interval"}
#: where text may be read: the edge (the config's own module, the command line's options)
EDGE = {"config.py", "options.py", "cli.py"}


def test_text_becomes_values_and_config_json_keeps_the_text():
    cfg = RunConfig(link="1gbit,2ms", budget="target,seconds=40", faults=["kill:1@3"], checkpoint_every="30s")
    assert cfg.link == Link(1e9, 0.002) and isinstance(cfg.budget, Budget)
    assert (cfg.budget.target, cfg.budget.seconds) == (True, 40.0)
    assert cfg.faults == [Fault("kill", 1, 3, 0.0, "kill:1@3")] and cfg.checkpoint_every == Cadence(seconds=30.0)
    d = cfg.to_dict()
    assert {k: d[k] for k in ("link", "budget", "faults", "checkpoint_every")} == {
        "link": "1gbit,2ms", "budget": "target,seconds=40", "faults": ["kill:1@3"], "checkpoint_every": "30s"}
    assert RunConfig.from_dict(json.loads(json.dumps(d))) == cfg
    assert RunConfig(checkpoint_every=50).to_dict()["checkpoint_every"] == 50


def test_a_config_changes_only_into_a_new_one_typed_too():
    import dataclasses

    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.link = "100mbit"
    cfg = dataclasses.replace(cfg, link="100mbit")  # (crossover gives every job the plan's link)
    assert cfg.link == Link(100e6, 0.0) and str(cfg.link) == "100mbit"
    with pytest.raises(ConfigError, match=r"^bad --link bandwidth 'fast'"):
        dataclasses.replace(cfg, link="fast")
    with pytest.raises(ConfigError, match=r"^config field faults must be a list of strings, got 'kill:1@3'$"):
        RunConfig(faults="kill:1@3")


def test_one_link_type_for_runs_and_the_simulator():
    from distsync.sim import Link as SimLink

    assert SimLink is Link and parse_link("1gbit,1ms").transfer_s(125e6) == pytest.approx(1.001)


def _calls(tree: ast.AST):
    """(function name called, name of the function or class body it is in) for every call."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else where
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name:
                    yield name, where
            yield from walk(child, inner)
    yield from walk(tree, "<module>")


def test_no_module_below_the_edge_parses_a_run_options_text():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in EDGE:
            continue
        for name, where in _calls(ast.parse(path.read_text())):
            # A dataclass that takes text makes it a value as it is made: that is the edge too.
            if name in PARSERS and where not in ("__post_init__", "__setattr__"):
                found.append(f"{rel}: {name}() in {where}")
    assert not found, "run options' text parsed below the edge: " + "; ".join(found)


def test_the_check_sees_a_parse_below_the_edge():
    tree = ast.parse("def f(cfg):\n    return parse_link(cfg.link)\n")
    assert [(n, w) for n, w in _calls(tree) if n in PARSERS] == [("parse_link", "f")]


def test_the_config_holds_no_launcher_decisions_and_config_json_carries_them_beside_it(tmp_path):
    import dataclasses

    from distsync.config import LAUNCH_KEYS
    from distsync.runtime.resolve import Launch, read_resolved, resolve

    assert not {f.name for f in dataclasses.fields(RunConfig)} & set(LAUNCH_KEYS)
    run = resolve(RunConfig(workers=2, steps=4, budget=None, link="1gbit,1ms", faults=["kill:1@2"]))
    slot = {"address": "/tmp/token.sock", "job": 1}
    run = dataclasses.replace(run, launch=Launch(latency_mode="comm", crossover=slot, resume=True))
    run.write(tmp_path / "config.json")
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["resolved"] is True and on_disk["link"] == "1gbit,1ms" and on_disk["faults"] == ["kill:1@2"]
    back = read_resolved(tmp_path / "config.json")
    assert back.launch == Launch(latency_mode="comm", crossover=slot, resume=True)
    assert back.config == run.config and back.role_of == run.role_of
    assert RunConfig.read(tmp_path / "config.json") == run.config  # (a run folder's config, as a config)


def test_a_config_no_launcher_wrote_is_refused_where_a_process_reads_it(tmp_path):
    from distsync.runtime.resolve import read_resolved

    RunConfig(workers=2).write(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="was not written by a launcher"):
        read_resolved(tmp_path / "config.json")


def test_a_budget_keeps_the_users_text_beside_its_own_form():
    b = RunConfig(budget="target=0.9, samples=10").budget
    assert (b.text, str(b)) == ("target=0.9, samples=10", "samples=10,target=0.9")
    assert RunConfig(budget=b).to_dict()["budget"] == "target=0.9, samples=10"
