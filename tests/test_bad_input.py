"""Bad input never ends in a traceback: any config file, jobs file or command line either
works or gives a one-line ``distsync: error: ...`` and exit code 2.

The property tests throw random content at the three ways in (``RunConfig.read``,
``load_plan``, ``distsync train/compare``); the parametrized ones pin the exact messages.
No process is started: the command-line tests replace ``launch`` with a stub, so an
accepted command line ends there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import time
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import distsync.runtime
from distsync import cli
from distsync.config import RunConfig
from distsync.errors import ConfigError
from distsync.experiments.crossover import _JOB_KEYS, load_plan
from distsync.options import finite_float
from helpers import assert_one_line, run_cli

FIELDS = [f.name for f in dataclasses.fields(RunConfig)]

# Function-scoped fixtures (tmp_path, capsys) are shared by a test's examples; each example
# overwrites its files and drains capsys first, so that is safe.
FAST = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---- values as config files hold them ------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-3, 70000)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
# Near-misses and good values of the fields' own kinds, so that examples also get past the
# type checks into the range checks.
plausible = st.sampled_from([
    0, 1, 2, 3, -1, 0.5, 1.5, 1e12, 65536, "", "digits", "sgd", "lars", "cpu", "cuda", "30s", "0s", "50", "abc",
    "200mbit", "1gbit,2ms", "8bit", "kill:1@3", "kill:server@2", "stall:0@1:2", "nan:1@1", "train", "linktest",
    ["kill:0@1"], ["stall:1@2:0.5", "kill:coordinator@1"], ["kill:9@1"], [], {}, {"1": 3}, {"0": 1.5, "1": 2},
    {"5": 2}, {"x": 1}, {"rows": 100}, {"bucket_mb": 1.0}, {"address": "/tmp/x", "job": 0},
])
field_values = json_values | plausible
strings = st.sampled_from(["digits", "allreduce", "ddp", "sgd", "adam", "lars", "adagrad", "auto", "cpu", "train",
                           "linktest", "30s", "5", "200mbit", "1gbit,2ms", "comm", "x"])
fault_specs = st.sampled_from(["kill:1@3", "kill:server@2", "kill:embedding-server@1", "stall:0@1:2", "nan:1@1", "kill:5@1"])


def of_type(hint: Any) -> st.SearchStrategy:
    """Values of a field's declared type, mostly in range: these get past the type checks
    and exercise the range checks behind them."""
    if hint is Any:
        return json_values
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-3, 70000)
    if hint is float:
        return st.floats(-1, 20)
    if hint is str:
        return strings
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return st.lists(fault_specs, max_size=2)
    if typing.get_origin(hint) is dict:  # json.dumps writes int keys as strings, as a file has them
        return st.dictionaries(st.integers(-1, 3) if args[0] is int else st.text(max_size=6),
                               of_type(args[1]), max_size=2)
    return st.one_of([of_type(a) for a in args])  # a union


HINTS = typing.get_type_hints(RunConfig)
DEFAULTS = dataclasses.asdict(RunConfig())


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """``good`` three times in four: an example with several values gets all of them right
    often enough to reach the checks that come after the first wrong one."""
    return st.integers(0, 3).flatmap(lambda i: bad if i == 0 else good)


def field_value(name: str) -> st.SearchStrategy:
    return mostly(st.just(DEFAULTS[name]) | of_type(HINTS[name]), field_values)


@st.composite
def config_objects(draw) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True))
    obj = {name: draw(field_value(name)) for name in names}
    if draw(st.integers(0, 9)) == 0:  # now and then a key that is no field
        obj[draw(st.text(max_size=8))] = draw(json_values)
    return obj


@given(obj=config_objects())
@settings(FAST, max_examples=300)
def test_any_config_object_is_read_or_refused_in_one_line(tmp_path, obj):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(obj))  # NaN and Infinity too, as Python's json reads them
    try:
        cfg = RunConfig.read(path)
    except ConfigError as e:
        event("refused")
        assert_one_line(str(e))
        return
    event("accepted")
    # What is accepted is a config: it writes and reads back as itself.
    cfg.write(tmp_path / "again.json")
    assert RunConfig.read(tmp_path / "again.json") == cfg


@given(content=st.text(max_size=60) | st.binary(max_size=40) | json_values.map(json.dumps))
@settings(FAST, max_examples=100)
def test_any_config_file_content_is_read_or_refused_in_one_line(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    try:
        RunConfig.read(path)
    except ConfigError as e:
        assert_one_line(str(e))


@pytest.mark.parametrize("obj, message", [
    ({"workers": "two"}, "config field workers must be an integer, got 'two'"),
    ({"workers": True}, "config field workers must be an integer, got True"),
    ({"lr": [1]}, "config field lr must be a finite number or null, got [1]"),
    ({"lr": math.nan}, "config field lr must be a finite number or null, got nan"),
    ({"timeout_s": math.inf}, "config field timeout_s must be a finite number, got inf"),
    ({"timeout_s": "x"}, "config field timeout_s must be a finite number, got 'x'"),
    ({"seed": 1.5}, "config field seed must be an integer, got 1.5"),
    ({"seed": 2**60}, "--seed must be an integer in -9007199254740991..9007199254740991, got 1152921504606846976"),
    ({"slow": 5}, "config field slow must be an object mapping integers to finite numbers, got 5"),
    ({"slow": {"one": 2}}, "config field slow must be an object mapping integers to finite numbers, got {'one': 2.0}"),
    ({"solver_options": 3}, "config field solver_options must be an object mapping strings to any values, got 3"),
    ({"faults": "kill:1@3"}, "config field faults must be a list of strings, got 'kill:1@3'"),
    ({"checkpoint_every": 2.5}, "config field checkpoint_every must be an integer, a string or null, got 2.5"),
    ({"checkpoint_every": "9" * 400 + "s"}, "bad --checkpoint-every '999"),
    ({"tensorboard": "yes"}, "config field tensorboard must be true or false, got 'yes'"),
    ({"a\nb": 1}, "unknown config field(s): 'a\\nb'"),
])
def test_config_file_type_errors_name_field_and_kind(tmp_path, obj, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ConfigError) as e:
        RunConfig.read(path)
    assert message in str(e.value)
    assert_one_line(str(e.value))


def test_negative_seed_is_accepted(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"seed": -7, "slow": {"1": 3}}')
    assert RunConfig.read(path).seed == -7


# ---- jobs files ---------------------------------------------------------------------------
def toml_value(v: Any) -> str | None:
    """``v`` as a TOML inline value; None (TOML has no null) as None."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        items = [toml_value(x) for x in v]
        return "[" + ", ".join(x for x in items if x is not None) + "]"
    if isinstance(v, dict):
        items = [(json.dumps(k, ensure_ascii=False), toml_value(x)) for k, x in v.items()]
        return "{" + ", ".join(f"{k} = {x}" for k, x in items if x is not None) + "}"
    return None


def toml_document(doc: dict[str, Any]) -> str:
    # Inline tables and arrays parse to the same data as [crossover] and [[job]] sections.
    lines = [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in doc.items()
             if toml_value(v) is not None]
    return "\n".join(lines) + "\n"


head_values = {
    "workers": st.integers(-1, 4),
    "policy": st.sampled_from(["alternate", "fcfs", "lifo"]),
    "modes": st.sampled_from(["crossover,naive", ["sequential"], ["crossover", "bogus"], [], "sequential,,"]),
    "link": st.sampled_from(["200mbit", "1gbit,2ms", "fast"]),
    "out": st.sampled_from(["runs/x", ""]),
}


def job_value(name: str) -> st.SearchStrategy:
    # Solver names stay names: a value with ":" is an import path, and random ones import modules.
    return field_value(name).filter(lambda v: not (isinstance(v, str) and ":" in v))


@st.composite
def job_tables(draw) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(_JOB_KEYS)), max_size=5, unique=True))
    job = {k: draw(job_value(k)) for k in keys}
    if "solver" in job and draw(st.booleans()):
        job["solver"] = draw(st.sampled_from(["allreduce", "ddp", "hogwild", "ripples"]))
    if draw(st.integers(0, 3)) == 0:
        job["name"] = draw(st.sampled_from(["a", "", "../x", "a b", "."]) | scalars)
    if draw(st.integers(0, 19)) == 0:
        job[draw(st.text(max_size=6))] = draw(json_values)
    return job


@st.composite
def jobs_documents(draw) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    shape = draw(st.integers(0, 9))
    if shape == 0:  # neither table nor array of tables where one belongs
        doc["crossover"] = draw(json_values)
        doc["job"] = draw(json_values)
        return doc
    keys = draw(st.lists(st.sampled_from(sorted(head_values)), max_size=4, unique=True))
    doc["crossover"] = {k: draw(mostly(head_values[k], field_values)) for k in keys}
    jobs = draw(mostly(st.lists(job_tables(), min_size=2, max_size=3), st.lists(job_tables(), max_size=1)))
    for i, job in enumerate(jobs):
        job.setdefault("name", f"j{i}")
    doc["job"] = jobs
    if draw(st.integers(0, 9)) == 0:
        doc[draw(st.text(max_size=6))] = draw(json_values)
    return doc


@given(doc=jobs_documents())
@settings(FAST, max_examples=200)
def test_any_jobs_file_is_planned_or_refused_in_one_line(tmp_path, doc):
    path = tmp_path / "jobs.toml"
    path.write_text(toml_document(doc))
    try:
        plan = load_plan(path)
    except ConfigError as e:
        event("refused")
        assert_one_line(str(e))
        return
    event("accepted")
    assert len(plan.jobs) >= 2 and all(j.config.workers == plan.workers for j in plan.jobs)


@given(content=st.text(max_size=60) | st.binary(max_size=40))
@settings(FAST, max_examples=60)
def test_any_jobs_file_content_is_planned_or_refused_in_one_line(tmp_path, content):
    path = tmp_path / "jobs.toml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    try:
        load_plan(path)
    except ConfigError as e:
        assert_one_line(str(e))


@pytest.mark.parametrize("text, message", [
    ("job = 3", "job must be an array of tables (one [[job]] per job), got 3"),
    ("[job]\nname = 'a'", "job must be an array of tables (one [[job]] per job), got {'name': 'a'}"),
    ("crossover = [1]", "crossover must be a table ([crossover]), got [1]"),
    ("[crossover]\nworkers = 'two'", "[crossover] key workers must be an integer, got 'two'"),
    ("[crossover]\nmodes = [1]", "[crossover] key modes must be a list of strings, got [1]"),
    ("[crossover]\nworkers = 0\n[[job]]\nname='a'\n[[job]]\nname='b'",
     "crossover: workers must be an integer >= 1, got 0"),
    ("[[job]]\nname = 'a'\nlr = 'fast'", "job a: key lr must be a finite number or null, got 'fast'"),
    ("[[job]]\nname = 'a'\nsteps = nan", "job a: key steps must be an integer or null, got nan"),
    ("[[job]]\nname = 'a'\nslow = {x = 2}", "job a: key slow must be an object mapping integers to finite numbers"),
    ("[[job]]\nname = '../up'", "[[job]] number 1: name must be a string of letters, digits"),
    ("[[job]]\nname='a'\nlr=-1\n[[job]]\nname='b'", "crossover: job a: --lr must be > 0, got -1"),
    ("x = 99999" + "9" * 5000, "is not valid TOML"),
])
def test_jobs_file_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "jobs.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        load_plan(path)
    assert message in str(e.value)
    assert_one_line(str(e.value))


# ---- command lines ------------------------------------------------------------------------
class Launched(Exception):
    """The command reached ``launch``: every check passed (no process is started)."""


def _no_launch(*args: Any, **kwargs: Any) -> dict[str, Any]:
    raise Launched


@pytest.fixture
def no_launch(monkeypatch):
    # `cli._cmd_train` imports `launch` from the package at call time; compare() bound it at
    # import; crossover and tests may reach the module's own. Replace all three.
    monkeypatch.setattr(distsync.runtime, "launch", _no_launch)
    monkeypatch.setattr(sys.modules["distsync.runtime.launch"], "launch", _no_launch)
    monkeypatch.setattr(sys.modules["distsync.experiments.compare"], "launch", _no_launch)
    handler = signal.getsignal(signal.SIGTERM)  # cli.main installs its own
    yield
    signal.signal(signal.SIGTERM, handler)


def run_main(argv: list[str], capsys) -> tuple[int | str, str]:
    """``(exit code or "launched", stderr)`` of ``distsync ARGV``."""
    capsys.readouterr()
    handler = signal.getsignal(signal.SIGTERM)  # (cli.main installs its own: a process forked later inherits it)
    try:
        code: int | str = cli.main(argv)
    except Launched:
        code = "launched"
    except SystemExit as e:
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, capsys.readouterr().err


def _options_of(command: str) -> list[argparse.Action]:
    sub = next(a for a in cli._build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction) and a.dest != "out"]


# Values for the options: junk, numbers of every kind (as text), and near-misses of each
# option's syntax. Workloads and solvers stay shipped names or names without ":" (a ":"
# imports a module); ctr and mnist are left to the explicit cases, as they take seconds.
numbers = (st.integers().map(str) | st.integers(-2, 5).map(str)
           | st.floats(allow_nan=True, allow_infinity=True).map(repr) | st.sampled_from(["nan", "inf", "-inf", "1e999"]))
specs = st.sampled_from([
    "1:3", "0:2,1:1.5", "1:0.5", "2:3", "200mbit", "1gbit,2ms", "fast", "30s", "0s", "0", "abc", "kill:1@3",
    "kill:9@1", "stall:0@2:1", "nan:server@1", "rows=5", "rows", "=1", "bucket_mb=1", "bucket_mb=nan", "overlap=maybe",
    "tau=0", "group_size=3", "sgd", "adam", "lars", "adagrad", "cpu", "cuda", "auto", "static", "best", "", "-", "--",
    "samples=1000", "seconds=2", "target", "target=0.9", "samples=0", "steps=3", "seconds=1,target",
])
names = st.text(max_size=10).filter(lambda s: ":" not in s and s not in ("mnist", "ctr"))
workloads = st.sampled_from(["digits", "wide", "cnn", "nope", "tests/fixtures/tiny_workload.py:make_workload",
                             "tests/fixtures/tiny_workload.py:make_it", "absent.py:x", "os.path:nope", ".rel:x"]) | names
solvers = st.sampled_from(["allreduce", "ddp", "ps", "ripples", "hogwild", "ad-psgd", "local", "nope",
                           "tests/fixtures/probe_solver.py:ProbeSolver", "absent.py:X"]) | names
values = st.text(max_size=16) | numbers | specs


def _value_of(action: argparse.Action) -> st.SearchStrategy:
    if action.dest == "workload":
        return workloads
    if action.dest in ("solver", "solvers"):
        return solvers
    if action.type is int:
        return mostly(st.integers(-1, 200).map(str), values)
    if action.type is finite_float:
        return mostly(st.floats(0, 2).map(repr), values)
    return values


@st.composite
def command_lines(draw, command: str) -> list[str]:
    argv = [command]
    for action in draw(st.lists(st.sampled_from(_options_of(command)), max_size=5)):
        flag = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:
            argv.append(flag)
            continue
        argv += [flag, draw(_value_of(action))]
    return argv


def _check_outcome(code: int | str, err: str) -> None:
    event(f"outcome: {code}")  # --hypothesis-show-statistics shows how many got how far
    assert code in (0, 2, "launched"), (code, err)
    if code == 2:
        assert_one_line(err)
        assert err.startswith("distsync: error: "), err


@given(argv=command_lines("train"))
@settings(FAST, max_examples=150)
def test_any_train_command_line_launches_or_fails_in_one_line(tmp_path, capsys, no_launch, argv):
    code, err = run_main(argv + ["--out", str(tmp_path / "run")], capsys)
    _check_outcome(code, err)


@given(argv=command_lines("compare"))
@settings(FAST, max_examples=60)
def test_any_compare_command_line_launches_or_fails_in_one_line(tmp_path, capsys, no_launch, argv):
    code, err = run_main(argv + ["--out", str(tmp_path / "cmp")], capsys)
    _check_outcome(code, err)


@pytest.mark.parametrize("args, message", [
    (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1 step, got 0"),
    (["--checkpoint-every", "abc"], "bad --checkpoint-every 'abc': expected STEPS or SECONDS with s, e.g. 50 or 30s"),
    (["--checkpoint-every", "0s"], "bad --checkpoint-every '0s': expected STEPS or SECONDS with s, e.g. 50 or 30s"),
    (["--max-restarts", "-1"], "--max-restarts must be an integer in 0..100, got -1"),
    (["--max-restarts", "1.5"], "argument --max-restarts: invalid int value: '1.5'"),
    (["--fault", "kill:9@1"], "bad --fault 'kill:9@1': rank 9 is not a worker (workers are ranks 0..1; "
                              "use server, coordinator or embedding-server for the other roles)"),
    (["--fault", "stall:0@1"], "bad --fault 'stall:0@1': a stall needs :SECONDS, e.g. stall:0@20:3"),
    (["--fault", "kill:²@1"], "bad --fault 'kill:²@1': expected kill:RANK@STEP"),
    (["--jitter", "nan"], "argument --jitter: expected a finite number, got 'nan'"),
    (["--lr", "inf"], "argument --lr: expected a finite number, got 'inf'"),
    (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
    (["--momentum=-inf"], "argument --momentum: expected a finite number, got '-inf'"),
    (["--weight-decay", "nan"], "argument --weight-decay: expected a finite number, got 'nan'"),
    (["--lars-eta", "1e999"], "argument --lars-eta: expected a finite number, got '1e999'"),
    (["--embedding-lr", "NaN"], "argument --embedding-lr: expected a finite number, got 'NaN'"),
    (["--timeout", "inf"], "argument --timeout: expected a finite number, got 'inf'"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--eval-every", "-3"], "--eval-every must be an integer >= 1, got -3"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be an integer >= 0, got -1"),
    (["--intra-op-threads", "0"], "--intra-op-threads must be an integer >= 1, got 0"),
    (["--embedding-servers", "-1"], "--embedding-servers must be an integer >= 0, got -1"),
    (["--master-port", "0"], "--master-port must be an integer in 1..65535, got 0"),
    (["--seed", "1" * 20], "--seed must be an integer in -9007199254740991..9007199254740991, got 11111111111111111111"),
    (["--jitter", "11"], "--jitter must be in [0, 10] (a share of each step's compute), got 11.0"),
    (["--device-ms", "0"], "--device-ms must be > 0 milliseconds, got 0.0"),
    (["--device-ms", "-5"], "--device-ms must be > 0 milliseconds, got -5.0"),
    (["--device-ms", "inf"], "argument --device-ms: expected a finite number, got 'inf'"),
    (["--budget", "epochs=3"], "bad --budget 'epochs=3': unknown budget kind 'epochs'; expected samples=N, "
                               "seconds=S, target or target=VALUE"),
    (["--budget", "samples=0"], "bad --budget 'samples=0': samples must be > 0"),
    (["--budget", "seconds=-1"], "bad --budget 'seconds=-1': seconds must be > 0"),
    (["--budget", "samples=1.5"], "bad --budget 'samples=1.5': samples needs a whole number, e.g. samples=50000"),
    (["--budget", "seconds=9,seconds=3"], "bad --budget 'seconds=9,seconds=3': seconds is given twice"),
    (["--budget", "seconds=60", "--steps", "10"], "--budget and --steps conflict: a job budget replaces the steps "
                                                  "per worker; give one"),
    (["--slow", "1:" + "9" * 400], "FACTOR must be a finite number"),
    (["--link", "9" * 400 + "mbit"], "expected a finite number, e.g. 200mbit"),
    (["--workload", "ctr", "-w", "rows=abc"], "workload ctr: option rows='abc' is not a valid int"),
    (["--workload", "ctr", "--rows", "5"], "rows must be an integer >= 10"),
    (["-w", "a\nb=1"], "bad --workload-option 'a\\nb=1': KEY must be a name without spaces, e.g. rows"),
    (["-o", "a b=1"], "bad --solver-option 'a b=1': KEY must be a name without spaces, e.g. rows"),
    (["--workload", ".rel:x"], "workload module .rel cannot be imported"),
    (["--optimizer", "lbfgs"], "unknown --optimizer 'lbfgs'; valid: sgd, adam, adamw, lars"),
    (["--device", "tpu"], "unknown --device 'tpu'; valid: auto, cpu, cuda"),
    (["--workers", "x\ny"], "argument --workers: invalid int value: 'x\\ny'"),
    (["stray\nword"], "unrecognized arguments: stray\\nword"),
])
@pytest.mark.parametrize("command", ["train", "compare"])
def test_bad_option_gives_exit_2_and_one_exact_line(tmp_path, capsys, no_launch, command, args, message):
    code, err = run_main([command, *args, "--out", str(tmp_path / "run")], capsys)
    assert code == 2, err
    assert_one_line(err)
    assert message in err, err


@pytest.mark.parametrize("argv, message", [
    (["train", "--solver", "ea-wild", "--threads", "2", "--momentum", "0.9"],
     "ea-wild with 2 threads steps with plain lock-free SGD (Hogwild): it takes --optimizer sgd without --momentum "
     "or --weight-decay; got --optimizer sgd --momentum 0.9 --weight-decay 0"),
    # (hogwild's servers refuse it first: they apply plain SGD too)
    (["train", "--solver", "hogwild", "--optimizer", "adam"],
     "solver hogwild: lock-free servers apply plain SGD (Hogwild); optimizer adam needs a lock: use async-ps"),
    (["compare", "--solvers", "allreduce,shadow-ma", "--threads", "2", "--weight-decay", "0.01"],
     "shadow-ma with 2 threads steps with plain lock-free SGD"),
])
def test_hogwild_threads_refuse_an_optimizer_they_would_not_run(tmp_path, capsys, no_launch, argv, message):
    code, err = run_main([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 2, err
    assert_one_line(err)
    assert message in err, err


@pytest.mark.parametrize("argv", [["train", "--solver", "ad-psgd"], ["compare", "--solvers", "allreduce,ad-psgd"]])
def test_a_budget_with_checkpoints_needs_equal_steps(tmp_path, capsys, no_launch, argv):
    code, err = run_main([*argv, "--budget", "target", "--checkpoint-every", "5", "--out", str(tmp_path / "r")], capsys)
    assert code == 2, err
    assert_one_line(err)
    assert ("--budget with --checkpoint-every needs a solver whose workers take equal steps; ad-psgd's workers "
            "step on their own") in err


@pytest.mark.parametrize("argv, message", [
    (["linktest", "--timeout", "nan"], "argument --timeout: expected a finite number, got 'nan'"),
    (["simulate", "--compute-ms", "inf"], "argument --compute-ms: expected a finite number, got 'inf'"),
    (["simulate", "--slow-factor", "nan"], "argument --slow-factor: expected a finite number, got 'nan'"),
])
def test_float_options_of_other_commands_refuse_nan_and_inf(capsys, no_launch, argv, message):
    code, err = run_main(argv, capsys)
    assert code == 2 and message in err, err
    assert_one_line(err)


def test_good_command_line_reaches_launch(tmp_path, capsys, no_launch):
    code, err = run_main(["train", "--steps", "3", "--seed", "-1", "--fault", "kill:1@2", "--checkpoint-every", "30s",
                          "--out", str(tmp_path / "run")], capsys)
    assert code == "launched", err


def test_a_job_this_machine_cannot_start_is_refused_at_once_in_one_line(tmp_path):
    from distsync.runtime.launch import check_room

    check_room(4)  # (nothing to say)
    with pytest.raises(ConfigError, match=r"a job of 10000000 processes needs .*; use fewer --workers") as e:
        check_room(10_000_000)
    assert_one_line(str(e.value))
    t0 = time.monotonic()
    proc = run_cli("train", "--workers", "1000000", "--out", str(tmp_path / "r"))
    # (digits' 1437 samples for a million workers: refused before the launcher counts processes)
    assert proc.returncode == 2 and "use --workers 44 or fewer" in proc.stderr and time.monotonic() - t0 < 10
    assert_one_line(proc.stderr)


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize("args, message", [
    (["--workload", "tests/fixtures/tiny_workload.py:make_workload", "--workers", "600"],
     "more workers than training samples: workload tiny has 500 for 600 workers, so a worker would get none; "
     "use --workers 31 or fewer"),
    (["--batch-size", "1000"],
     "workload digits's 1437 training samples, dealt to 2 workers, leave the smallest share 718, fewer than the "
     "batch size 1000; use --batch-size 718 or less, or --workers 1"),
    (["--solver", "hogwild", "--batch-size", "400"],
     "workload digits's 1437 training samples, dealt to 2 workers x 2 threads, leave the smallest share 359, fewer "
     "than the batch size 400; use --batch-size 359 or less, or --workers 1"),
    (["--workload", "tests/fixtures/loader_workload.py:make_workload", "-w", "n=60", "--workers", "5"],
     "workload loader's training data has 4 batches, fewer than the 5 workers: a pass deals one batch to each in "
     "whole rounds, so a worker would get none; use --workers 4 or fewer"),
])
def test_data_too_small_for_the_workers_is_refused_before_any_process_starts(tmp_path, capsys, no_launch, command,
                                                                              args, message):
    if command == "compare" and "--solver" in args:
        args = ["--solvers", *args[1:]]
    code, err = run_main([command, *args, "--out", str(tmp_path / "run")], capsys)
    assert code == 2, err  # (not "launched")
    assert_one_line(err)
    assert err == f"distsync: error: {message}\n"
