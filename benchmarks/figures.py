"""Every published figure from one command: which benchmark backs which table, and whether the
committed docs still say what the committed raw results say.

A *figure* is a benchmark run whose raw results file is committed under
``docs/benchmarks/raw/NAME.json`` (written by the benchmark script only, with the command,
commit, date, machine, regime, seeds and repeats) and rendered into the docs by the script's
own ``render(raw)``: each rendered block sits in a page between ``<!-- figure: BLOCK -->`` and
``<!-- /figure: BLOCK -->``. The README's "which solver when" table is one such block,
rendered here from several raw files.

    python benchmarks/figures.py run [--quick | --stale] [NAME ...]   # run the benchmarks (make figures)
    python benchmarks/figures.py render                     # rewrite the docs' blocks from raw
    python benchmarks/figures.py check                      # make figures-check
    python benchmarks/figures.py list

``run`` writes the raw files (``--quick``: a small smoke run of each, into
``benchmarks/results/quick/``, never over the committed ones) and renders. ``check`` fails
(exit status 1) when a block differs from what its raw file renders, a raw file lacks its
provenance, was made by another command than the registry's, or has fewer than 3 repeats, or
a table in ``docs/benchmarks/`` stands outside a rendered block.

A figure run by name only (hours, or scored once) may be registered before its first run: with
no raw file its block says "Not measured yet" and how to measure it, and ``check`` lists it
without failing; any other figure's missing raw file is a failure (``make figures`` makes it).

A figure is stale when a file its run imported (recorded in its raw file, each with a hash of
its syntax tree, so that comments and docstrings do not count) is no longer what it measured;
its blocks then end with "Stale: measured at X; changed since: ...", and ``check`` lists it
without failing: a fix never waits for a figure. ``run --stale`` re-runs those. A raw file
made before that record judges by the files under its declared sources instead.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import source_hash, syntax_hash, tree_blobs  # noqa: E402
RAW = REPO / "docs" / "benchmarks" / "raw"
QUICK = REPO / "benchmarks" / "results" / "quick"
#: what every raw results file must say about how it was made
PROVENANCE = ("command", "commit", "dirty", "date", "machine", "regime", "seeds", "repeats")
MIN_REPEATS = 3

#: what every training run exercises: a figure that measures training declares these too
#: allreduce's code: the solver and its next-forward overlap
ALLREDUCE = ("src/distsync/solvers/allreduce.py", "src/distsync/solvers/next_forward.py")
RUNTIME = ("src/distsync/comm", "src/distsync/runtime", "src/distsync/membership", "src/distsync/metrics",
           "src/distsync/workloads", "src/distsync/solvers/base.py", "src/distsync/solvers/__init__.py",
           "src/distsync/solvers/rules.py", "src/distsync/solvers/flat.py", "src/distsync/solvers/hogwild_threads.py",
           "src/distsync/solvers/lars.py", "src/distsync/solvers/buffers.py", "src/distsync/solvers/plan.py",
           "src/distsync/solvers/own_loop.py", "src/distsync/config.py", "src/distsync/worker.py",
           "src/distsync/supervise.py")
#: recommend's code: the command, its candidates, its train mode and staged search, its outputs
RECOMMEND = ("src/distsync/experiments/recommend.py", "src/distsync/experiments/proposal.py",
             "src/distsync/experiments/staged_search.py", "src/distsync/experiments/recommend_outputs.py")


@dataclass(frozen=True)
class Figure:
    """One benchmark run behind published figures."""

    name: str  #: the raw file's name: docs/benchmarks/raw/NAME.json
    #: the script: a module in benchmarks/, or a path from the repository's root without
    #: ``.py`` (its ``render(raw) -> {block: markdown}`` is the renderer)
    script: str
    args: tuple[str, ...]  #: the full run's arguments
    quick: tuple[str, ...]  #: a smoke run's arguments (none: no smoke run, as with ``by_name_only``)
    sources: tuple[str, ...]  #: the source paths whose change makes its raw results stale
    page: str  #: the docs page holding its blocks
    #: repeats a published figure needs (1 only where a repeat cannot differ: a pass/fail census)
    min_repeats: int = 3
    #: it measures a CUDA GPU: ``run`` skips it, saying so, on a machine without one (``make gpu``)
    needs_gpu: bool = False
    #: why ``run`` without names leaves it out (a test set scored once per published result, at
    #: its measured commit): it runs when named
    by_name_only: str = ""
    #: a test set scored once, at the commit it names: a release keeps it as it is (docs/release.md)
    scored_once: bool = False

    @property
    def path(self) -> str:
        return f"{self.script}.py" if "/" in self.script else f"benchmarks/{self.script}.py"

    def raw_path(self, quick: bool = False) -> Path:
        return (QUICK if quick else RAW) / f"{self.name}.json"

    def command(self, quick: bool = False) -> list[str]:
        return [sys.executable, self.path, *(self.quick if quick else self.args),
                "--json", str(self.raw_path(quick).relative_to(REPO))]

    def renderer(self) -> Callable[[dict[str, Any]], dict[str, str]]:
        """The script's ``render``; one that returns a single markdown text renders the block
        named after the figure."""
        if "/" not in self.script:
            render = importlib.import_module(self.script).render
        else:
            spec = importlib.util.spec_from_file_location(Path(self.script).name, REPO / self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # (dataclasses look their module up there)
            spec.loader.exec_module(module)
            render = module.render

        def blocks(raw: dict[str, Any]) -> dict[str, str]:
            out = render(raw)
            return {self.name: out} if isinstance(out, str) else out

        return blocks


#: what the heterogeneity figures' runs depend on beyond the runtime
HETEROGENEITY = RUNTIME + (*ALLREDUCE, "src/distsync/solvers/decentralized.py",
                           "src/distsync/solvers/schedules.py", "src/distsync/solvers/parameter_server.py",
                           "src/distsync/solvers/elastic.py", "src/distsync/solvers/shard_service.py")

FIGURES = [
    Figure("real_sizes", "real_sizes", ("--parts", "ring", "--models", "resnet50", "--links", "1gbit",
                                        "--workers", "4,8", "--seeds", "1,2,3", "--solvers",
                                        "allreduce,allreduce:next_forward=false,allreduce:bucket_mb=8,ddp,"
                                        "ddp:bucket_mb=8"),
           ("--parts", "ring", "--models", "resnet50", "--links", "10gbit", "--workers", "2", "--seeds", "1",
            "--steps", "4"),
           RUNTIME + (*ALLREDUCE,
                      "src/distsync/solvers/ddp.py",
                      "src/distsync/workloads/resnet50.py", "src/distsync/workloads/gpt2.py"),
           "docs/benchmarks/real_sizes.md"),
    Figure("next_forward_equal", "next_forward_equal", (),
           ("--workloads", "digits", "--workers", "2", "--steps", "5"),
           RUNTIME + (*ALLREDUCE,), "docs/benchmarks/real_sizes.md", min_repeats=1),
    Figure("next_forward_hooks", "next_forward_hooks", ("--batch", "8", "--steps", "12"),
           ("--batch", "2", "--steps", "5", "--rounds", "1"), RUNTIME + (*ALLREDUCE,),
           "docs/benchmarks/real_sizes.md"),
    Figure("next_forward_hooks-gpu", "next_forward_hooks", ("--device", "cuda"),
           ("--device", "cuda", "--steps", "5", "--rounds", "1"), RUNTIME + (*ALLREDUCE,), "docs/gpu.md",
           needs_gpu=True),
    Figure("real_sizes_gpt2", "real_sizes", ("--parts", "ring", "--models", "gpt2", "--workers", "4,8", "--solvers",
                                           "allreduce,ddp", "--seeds", "1,2,3", "--steps", "4"),
           ("--parts", "ring", "--models", "gpt2", "--links", "10gbit", "--workers", "2", "--seeds", "1",
            "--steps", "4"),
           RUNTIME + (*ALLREDUCE,
                      "src/distsync/solvers/ddp.py",
                      "src/distsync/workloads/gpt2.py", "src/distsync/workloads/lm.py"),
           "docs/benchmarks/real_sizes.md"),
    Figure("real_sizes_servers", "real_sizes",
           ("--parts", "servers", "--models", "resnet50", "--links", "1gbit,10gbit", "--workers", "4,8",
            "--seeds", "1,2,3", "--steps", "4"),
           ("--parts", "servers", "--models", "resnet50", "--links", "10gbit", "--workers", "2", "--seeds", "1",
            "--steps", "3"),
           RUNTIME + ("src/distsync/solvers/parameter_server.py", "src/distsync/solvers/shard_service.py",
                      "src/distsync/workloads/resnet50.py"),
           "docs/benchmarks/real_sizes.md"),
    Figure("release_check", "release_check", (), (),
           ("benchmarks/release_check.py", "pyproject.toml", "README.md", "src/distsync/cli.py"), "docs/release.md",
           min_repeats=1, by_name_only="the release check installs torch releases from PyPI: make release-check"),
    Figure("allreduce_vs_ddp", "allreduce_vs_ddp", ("--rounds", "3"),
           ("--rounds", "1", "--rows", "digits:2"),
           RUNTIME + (*ALLREDUCE, "src/distsync/solvers/ddp.py"),
           "docs/benchmarks/allreduce_vs_ddp.md"),
    Figure("allreduce_vs_ddp-gpu", "allreduce_vs_ddp", ("--device", "cuda", "--rows", "digits:1,cnn:1"),
           ("--device", "cuda", "--rounds", "1", "--rows", "digits:1"),
           RUNTIME + (*ALLREDUCE, "src/distsync/solvers/ddp.py"),
           "docs/gpu.md", needs_gpu=True),
    Figure("peers", "peers", ("--seeds", "1,2,3"),
           ("--seeds", "1", "--pairs", "ma/torch-post-local-sgd", "--workers", "2", "--cap", "3"),
           RUNTIME + (*ALLREDUCE, "src/distsync/solvers/ddp.py",
                      "src/distsync/solvers/model_averaging.py", "src/distsync/solvers/diloco.py",
                      "src/distsync/solvers/compression.py", "src/distsync/solvers/peers.py"),
           "docs/benchmarks/peers.md"),
    Figure("diloco_quality", "diloco", ("--part", "quality"),
           ("--part", "quality", "--seeds", "1", "--steps", "20"),
           ("src/distsync/sim", "src/distsync/solvers/diloco.py", "src/distsync/solvers/model_averaging.py",
            "src/distsync/solvers/rules.py", "src/distsync/solvers/base.py", "src/distsync/workloads",
            "src/distsync/options.py"),
           "docs/benchmarks/diloco.md"),
    Figure("diloco_overlap", "diloco", ("--part", "overlap"),
           ("--part", "overlap", "--seeds", "1", "--overlap-steps", "20"),
           RUNTIME + ("src/distsync/solvers/diloco.py", "src/distsync/solvers/model_averaging.py"),
           "docs/benchmarks/diloco.md"),
    Figure("heterogeneity_devices", "heterogeneity_devices",
           ("--workers", "4,8", "--cases", "homogeneous,one 3x slow", "--seeds", "1,2,3"),
           ("--workers", "2", "--cases", "one 3x slow", "--seeds", "1", "--solvers", "allreduce,ripples:smart",
            "--cap", "2"),
           HETEROGENEITY,
           "docs/benchmarks/heterogeneity.md"),
    *(Figure(f"heterogeneity_devices_{w}-gpu", "heterogeneity_devices",
             ("--workload", w, "--device", "cuda", "--workers", "4", "--cases", "one 3x slow", "--solvers",
              "allreduce,ad-psgd,ripples:smart:overlap=true", "--seeds", "1,2,3", "--cap", "40"),
             ("--workload", w, "--device", "cuda", "--workers", "2", "--cases", "one 3x slow", "--seeds", "1",
              "--solvers", "allreduce,ripples:smart", "--cap", "2"),
             RUNTIME + (*ALLREDUCE, "src/distsync/solvers/decentralized.py",
                        "src/distsync/solvers/schedules.py"),
             "docs/benchmarks/heterogeneity.md", needs_gpu=True) for w in ("cnn", "mnist")),
    Figure("heterogeneity_devices_16", "heterogeneity_devices",
           ("--workers", "8,16", "--cases", "one 3x slow,a quarter 3x slow", "--solvers",
            "allreduce,ad-psgd,ripples:smart:overlap=true", "--seeds", "1,2,3"),
           ("--workers", "9", "--cases", "one 3x slow", "--seeds", "1", "--solvers",
            "allreduce,ripples:smart:overlap=true", "--cap", "2"),
           HETEROGENEITY,
           "docs/benchmarks/heterogeneity.md"),
    Figure("async_vs_sync_devices", "async_vs_sync",
           ("--devices", "--workers", "4", "--settings", "wide", "--solvers",
            "allreduce,sync-easgd,async-measgd,ea-wild,ea-wild:tau=16,async-ps", "--seeds", "1,2,3"),
           ("--devices", "--workers", "2", "--settings", "wide", "--solvers", "allreduce,sync-easgd", "--seeds", "1",
            "--cap", "10"),
           RUNTIME + (*ALLREDUCE, "src/distsync/solvers/elastic.py",
                      "src/distsync/solvers/parameter_server.py", "src/distsync/solvers/shard_service.py"),
           "docs/benchmarks/async_vs_sync.md"),
    Figure("shadowsync_devices", "shadowsync",
           ("--devices", "--trainers", "1,2,4", "--min-interval-ms", "0", "--seeds", "1,2,3"),
           ("--devices", "--trainers", "2", "--steps", "30", "--min-interval-ms", "0", "--seeds", "1"),
           RUNTIME + ("src/distsync/solvers/shadow.py", "src/distsync/solvers/model_averaging.py",
                      "src/distsync/solvers/elastic.py", *ALLREDUCE, "src/distsync/sparse"),
           "docs/benchmarks/shadowsync.md"),
    Figure("crossover", "crossover", ("--cases", "emulated-device,emulated-4,emulated-4-jitter", "--repeats", "3"),
           ("--cases", "emulated-device", "--device-steps", "6", "--repeats", "1"),
           RUNTIME + (*ALLREDUCE, "src/distsync/experiments/crossover.py",
                      "src/distsync/runtime/token.py"),
           "docs/benchmarks/crossover.md"),
    # -- reliability: faults, kills, a lagging worker, startup --
    Figure("faults", "faults", ("--runs", "3", "--parts", "faults,bad-input"),
           ("--runs", "1", "--solvers", "allreduce,async-ps", "--parts", "faults"),
           RUNTIME + ("src/distsync/solvers", "src/distsync/cli.py", "src/distsync/options.py", "src/distsync/errors.py",
                      "src/distsync/experiments"),
           "docs/benchmarks/faults.md"),
    Figure("kill_campaign", "kill_campaign", ("--runs", "30"),
           ("--runs", "2", "--solvers", "async-ps", "--cases", "worker,server", "--steps", "80"),
           RUNTIME + ("src/distsync/solvers", "src/distsync/cli.py", "src/distsync/options.py", "src/distsync/errors.py"),
           "docs/benchmarks/kill_campaign.md"),
    Figure("lagging_worker", "lagging_worker", ("--parts", "lagging", "--runs", "20"),
           ("--parts", "lagging", "--runs", "2"),
           RUNTIME + ("src/distsync/solvers/decentralized.py", "src/distsync/solvers/schedules.py",
                      "src/distsync/cli.py", "src/distsync/options.py"),
           "docs/benchmarks/kill_campaign.md"),
    Figure("stopped_worker", "lagging_worker",
           ("--parts", "stop", "--families", "allreduce,bmuf,async-ps,ad-psgd,ripples", "--repeats", "3"),
           ("--parts", "stop", "--families", "allreduce", "--repeats", "1"),
           RUNTIME + (*ALLREDUCE, "src/distsync/solvers/model_averaging.py",
                      "src/distsync/solvers/parameter_server.py", "src/distsync/solvers/shard_service.py",
                      "src/distsync/solvers/decentralized.py", "src/distsync/solvers/schedules.py",
                      "src/distsync/cli.py", "src/distsync/options.py"),
           "docs/benchmarks/kill_campaign.md"),
    Figure("live_recovery", "live_recovery", ("--runs", "5"),
           ("--runs", "1", "--solvers", "allreduce"),
           RUNTIME + ("src/distsync/solvers", "src/distsync/cli.py", "src/distsync/options.py",
                      "src/distsync/errors.py", "benchmarks/kill_campaign.py"),
           "docs/reliability.md"),
    Figure("startup", "startup", ("--full", "--workers", "2,4", "--repeats", "3"),
           ("--workers", "2", "--repeats", "1", "--warmup", "0"),
           RUNTIME + ("src/distsync/cli.py", "src/distsync/__init__.py", "src/distsync/imports.py",
                      "src/distsync/options.py", "src/distsync/errors.py", "src/distsync/torch_private.py",
                      *ALLREDUCE, "src/distsync/experiments", "benchmarks/startup_profile"),
           "docs/benchmarks/startup.md"),
    # -- the simulator, recommend, emulated devices, links --
    Figure("simulator", "simulator", ("--seeds", "1,2,3"),
           ("--seeds", "1", "--speed-workers", "500", "--train-workers", "8"),
           ("src/distsync/sim", "src/distsync/solvers", "src/distsync/workloads"),
           "docs/benchmarks/simulator.md"),
    Figure("sim_speed", "sim_speed", ("--seeds", "1,2,3"),
           ("--sources", "100", "--timeouts", "50", "--workers", "2000", "--steps", "10", "--seeds", "1"),
           ("src/distsync/sim", "src/distsync/solvers"),
           "docs/benchmarks/simulator.md"),
    Figure("train_parity", "train_parity", ("--seeds", "0,1,2"),
           ("--seeds", "0", "--steps", "20", "--eval-every", "10", "--solvers", "allreduce,async-ps"),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers"),
           "docs/benchmarks/simulator.md"),
    Figure("fidelity_dev", "fidelity",
           ("--set", "dev", "--workers", "4,8", "--solvers", "allreduce,ripples:smart,ad-psgd", "--steps", "150",
            "--seeds", "1,2,3"),
           ("--set", "dev", "--workers", "4", "--solvers", "allreduce,ad-psgd", "--steps", "40", "--seeds", "1",
            "--out", "benchmarks/results/quick/fidelity"),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers", "benchmarks/fidelity.py"),
           "docs/benchmarks/simulator.md"),
    Figure("fidelity", "fidelity", ("--set", "test", "--rows", "12", "--seeds", "1,2,3"),
           ("--set", "test", "--rows", "1", "--seeds", "1", "--out", "benchmarks/results/quick/fidelity"),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers", "benchmarks/fidelity.py"),
           "docs/benchmarks/simulator.md"),
    Figure("sim_timing_dev", "sim_timing_dev", ("--fits", "benchmarks/results/sim_timing_dev", "--make-fits"),
           ("--raw", "docs/benchmarks/raw/recommend.json"),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers", *RECOMMEND,
                      "benchmarks/sim_timing_dev.py"),
           "docs/benchmarks/simulator.md"),
    # (the sweep takes no seed: its draws are seed 0's, so a repeat gives the same rows)
    Figure("sweep", "sweep",
           ("--solvers", "allreduce,ripples,ad-psgd,ea-wild,local", "--workers", "4,16,64,256", "--ratios",
            "0.1,0.3,1,3", "--slow-shares", "0,0.1,0.3", "--batch-size", "4", "-o", "ripples.schedule=smart",
            "-o", "ea-wild.tau=16", "-o", "ea-wild.servers=workers/4", "--out", "docs/sweep"),
           ("--solvers", "allreduce,ad-psgd", "--workers", "4", "--ratios", "1", "--slow-shares", "0,0.3",
            "--batch-size", "4", "--steps", "30", "--out", "benchmarks/results/quick/sweep"),
           ("src/distsync/sim", "src/distsync/solvers", "src/distsync/workloads", "src/distsync/options.py",
            "src/distsync/cli.py"),
           "docs/simulator.md", min_repeats=1),
    Figure("recommend_speed", "recommend_speed", (), ("--repeats", "1", "--loaded", "0", "--lstm-repeats", "0"),
           ("src/distsync/sim", "src/distsync/solvers", *RECOMMEND, "src/distsync/cli.py",
            "benchmarks/workloads/charlstm.py"),
           "docs/benchmarks/recommend.md"),
    Figure("recommend", "recommend", ("--set", "test", "--fit", "--seeds", "1,2,3"),
           ("--quick", "--solvers", "allreduce,ad-psgd", "--out", "benchmarks/results/quick/recommend"),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers", *RECOMMEND,
                      "benchmarks/recommend_scenarios.py", "benchmarks/workloads"),
           "docs/benchmarks/recommend.md",
           by_name_only="its test set is scored once per published result, at its measured commit, over hours",
           scored_once=True),
    Figure("recommend_test2", "recommend", ("--set", "test2", "--fit", "--seeds", "1,2"), (),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers", *RECOMMEND,
                      "benchmarks/recommend_scenarios.py", "benchmarks/workloads"),
           "docs/benchmarks/recommend.md", min_repeats=2,
           by_name_only="its test set is scored once per published result, at its measured commit, over hours",
           scored_once=True),
    # (one seed: 8 scenarios x 7 runs to the target in at most 6 hours; the scenarios are the repeats)
    Figure("recommend_test3", "recommend", ("--set", "test3", "--seeds", "1"), (),
           RUNTIME + ("src/distsync/sim", "src/distsync/solvers", *RECOMMEND, "src/distsync/experiments/auto.py",
                      "benchmarks/recommend_scenarios.py", "benchmarks/recommend_auto.py", "benchmarks/workloads"),
           "docs/benchmarks/recommend.md", min_repeats=1,
           by_name_only="its test set is scored once per published result, at its measured commit, over hours",
           scored_once=True),
    Figure("devices", "devices", ("--steps-scale", "0.5", "--seeds", "1,2,3"),
           ("--workloads", "digits", "--workers", "4", "--steps-scale", "0.25", "--seeds", "1",
            "--out", "benchmarks/results/quick/devices"),
           RUNTIME + (*ALLREDUCE,),
           "docs/benchmarks/devices.md"),
    Figure("link_efficiency", "link_efficiency", ("--repeats", "3"),
           ("--repeats", "1", "--sizes", "1", "--links", "1gbit,unshaped"),
           RUNTIME,
           "docs/benchmarks/link_efficiency.md"),
    # -- distsync beside other torch releases (a venv each, torch from PyPI: GBs, so by name only) --
    *(Figure(f"torch_versions-{v}", "torch_versions", ("--torch", f"{v}.0"), (),
             # (what decides whether a torch release runs: the requirement, the door to its private
             # names, and DDP's arguments; a change elsewhere is tested on the pinned torch)
             ("pyproject.toml", "constraints.txt", "src/distsync/torch_private.py", "src/distsync/solvers/ddp.py",
              "benchmarks/torch_versions.py"),
             "docs/torch-versions.md", min_repeats=1,
             by_name_only="it installs another torch beside the pinned one (about 5 GB from PyPI)")
      for v in ("2.11", "2.15")),
    # -- the mutation probe: which broken rules the fast suite catches (a census: one run each) --
    Figure("mutation_probe", "tests/mutation_probe", (), ("--check",),
           ("src/distsync/solvers", "src/distsync/sim", "tests/mutation_probe.py", "tests/helpers.py",
            "tests/conftest.py", "tests/test_rules.py", "tests/test_sim_rules.py", "tests/test_rule_references.py",
            "tests/test_decentralized.py", "tests/test_async_solvers.py", "tests/test_background.py",
            "tests/test_allreduce.py", "tests/test_sim_ordered.py", "tests/test_sim.py"),
           "docs/benchmarks/mutation_probe.md", min_repeats=1),
    # -- mutants a tool drew: which of them the fast suite kills, and each survivor's triage --
    Figure("mutants_drawn", "tests/mutants_drawn", ("--resume",), (),
           ("src/distsync/solvers", "src/distsync/sim/timing.py", "src/distsync/sim/timing_base.py",
            "src/distsync/sim/timing_decentralized.py", "tests/mutants_drawn.py", "tests/mutation_probe.py"),
           "docs/testing.md", min_repeats=1,
           by_name_only="hours: 170 mutants, each against the fast suite, in a worktree at a pinned commit"),
    # -- the whole suite again and again under load: which tests fail by chance (a run a repeat) --
    Figure("soak", "tools/soak", ("--runs", "10"), (),
           ("src/distsync", "tests", "tools/soak.py", "pyproject.toml", "constraints.txt"),
           "docs/testing.md",
           by_name_only="hours: the whole suite 10 times beside busy loops; "
                        "SOAK_OUT=docs/benchmarks/raw/soak.json make test-soak does the same"),
]
BY_NAME = {f.name: f for f in FIGURES}
BLOCK = re.compile(r"(<!-- figure: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /figure: (?P=name) -->)", re.S)


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def load_raw(fig: Figure, quick: bool = False) -> dict[str, Any] | None:
    path = fig.raw_path(quick)
    return json.loads(path.read_text()) if path.exists() else None


#: how a rendered block of a stale figure ends: what changed since it was measured
STALE_NOTE = "> Stale: "
#: the block of a figure run by name only that has no raw file yet
NOT_MEASURED = "> Not measured yet: "


def not_measured(fig: Figure) -> str | None:
    """The block of ``fig`` while it has no raw file: what to run (None: a missing raw file is a
    failure, as for every figure that ``make figures`` runs, but for those run by name only or
    on a GPU)."""
    if fig.needs_gpu:  # (made only where a GPU is lent: docs/gpu.md)
        return (f"{NOT_MEASURED}no raw results ({fig.raw_path().relative_to(REPO)}). It needs a CUDA GPU: "
                f"`make gpu` runs it there.\n")
    if not fig.by_name_only:
        return None
    return (f"{NOT_MEASURED}no raw results ({fig.raw_path().relative_to(REPO)}). Run by name only "
            f"({fig.by_name_only}): `python benchmarks/figures.py run {fig.name}`.\n")


def without_stale_notes(text: str) -> str:
    """``text`` less its :data:`STALE_NOTE` lines (and the blank line before each)."""
    return re.sub(r"\n*^" + re.escape(STALE_NOTE) + r".*$", "", text, flags=re.M)


def rendered_blocks(quick: bool = False, notes: bool = True) -> dict[str, tuple[str, str]]:
    """Every block the raw files render: ``{block: (page, markdown)}``, each of a stale figure
    ending (with ``notes``) in a :data:`STALE_NOTE` that says what changed since; a missing raw
    file renders nothing (``check`` says so), but a figure run by name only says it is not
    measured yet (:func:`not_measured`)."""
    out: dict[str, tuple[str, str]] = {}
    raws: dict[str, dict[str, Any]] = {}
    for fig in FIGURES:
        raw = load_raw(fig, quick)
        if raw is None:
            if not quick and not_measured(fig) is not None:
                out[fig.name] = (fig.page, not_measured(fig))
            continue
        raws[fig.name] = raw
        why = stale(fig, raw) if notes and not quick else None
        for block, text in fig.renderer()(raw).items():
            out[block] = (fig.page, text if why is None else f"{text.rstrip()}\n\n{STALE_NOTE}{why}.\n")
    from which_solver import render as which_solver

    text = which_solver(raws)
    if text is not None:
        out["which_solver"] = ("README.md", text)
    return out


@functools.lru_cache(maxsize=None)
def _tree_at(commit: str) -> dict[str, str]:
    """``{path: blob}`` of every file of ``commit``'s tree."""
    return tree_blobs(git("ls-tree", "-r", "-z", commit))


_BLOB_HASHES: dict[str, str] = {}


def _hashes_at(commit: str, paths: list[str]) -> dict[str, str | None]:
    """:func:`common.syntax_hash` of each of ``paths`` as ``commit`` had it (None: it had none)."""
    tree = _tree_at(commit)
    wanted = sorted({tree[p] for p in paths if p in tree and tree[p] not in _BLOB_HASHES})
    if wanted:
        done = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch"], input="\n".join(wanted).encode() + b"\n",
                              capture_output=True, check=True).stdout
        names = {tree[p]: p for p in paths if p in tree}
        at = 0
        for blob in wanted:
            header_end = done.index(b"\n", at)
            size = int(done[at:header_end].split()[2])
            _BLOB_HASHES[blob] = syntax_hash(done[header_end + 1:header_end + 1 + size], names[blob])
            at = header_end + 1 + size + 1
    return {p: _BLOB_HASHES[tree[p]] if p in tree else None for p in paths}


def _declared(fig: Figure, commit: str) -> list[str]:
    """The files under ``fig``'s declared sources, then (at ``commit``) and now."""
    def under(p: str) -> bool:
        return any(p == s or p.startswith(s.rstrip("/") + "/") for s in fig.sources)

    now = {str(p.relative_to(REPO)) for s in fig.sources for p in ([REPO / s] if (REPO / s).is_file()
                                                                   else (REPO / s).rglob("*")) if p.is_file()}
    return sorted({p for p in _tree_at(commit) if under(p)} | {p for p in now if "__pycache__" not in p})


def stale(fig: Figure, raw: dict[str, Any]) -> str | None:
    """Why ``raw`` no longer measures the code here (None when it does): a file its run
    imported (its ``imported`` record; a raw file made before there was one: a file under the
    figure's declared sources) whose syntax tree is not the one measured, so that a comment or
    docstring changes nothing; or a file that changed while the run ran."""
    commit = raw.get("commit")
    if not commit:
        return "records no commit"
    if "imported" in raw:
        measured = raw["imported"]
    else:
        try:
            measured = _hashes_at(commit, _declared(fig, commit))
        except (RuntimeError, subprocess.CalledProcessError):
            return f"measured commit {commit[:10]}, which this repository does not have"
        touched = set(raw.get("changed_files", []))  # (then uncommitted: what it measured is unknown)
        dirty = sorted(p for p in touched if p in measured)
        if dirty:
            return f"measured at {commit[:10]} with uncommitted changes to: {', '.join(dirty)}"
    during = raw.get("changed_during_run") or {}
    moved = set(during.get("changed_files", []))
    if during.get("commit") and during["commit"] != commit:
        moved |= set(git("diff", "--name-only", commit, during["commit"]).split())
    moved = sorted(p for p in moved if p in measured)
    if moved:
        return f"measured at {commit[:10]} while these changed: {', '.join(moved)}"
    changed = sorted(p for p, h in measured.items() if source_hash(REPO / p) != h)
    if not changed:
        return None
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    return f"measured at {commit[:10]}; changed since: {', '.join(changed[:6])}{more}"


def provenance_problems(fig: Figure, raw: dict[str, Any]) -> list[str]:
    problems = [f"{fig.name}: raw results lack {k!r}" for k in PROVENANCE if k not in raw]
    wanted = "python " + " ".join(fig.command()[1:])
    if "command" in raw and _without_places(raw["command"]) != _without_places(wanted):
        problems.append(f"{fig.name}: made by `{raw['command']}`, not by the registry's `{wanted}`")
    if isinstance(raw.get("repeats"), int) and raw["repeats"] < fig.min_repeats:
        problems.append(f"{fig.name}: {raw['repeats']} repeat(s); a published figure needs at least {fig.min_repeats}")
    return problems


def _without_places(command: str) -> str:
    """``command`` less its ``--json PATH``, ``--out DIR`` and ``--venv DIR``: where a run wrote
    its raw file and its runs' folders, and where it kept a venv, is not what it measured."""
    return re.sub(r" --(json|out|venv) \S+", "", command)


def stray_tables(text: str) -> list[int]:
    """Line numbers of markdown table rows outside rendered blocks."""
    inside, lines = set(), text.split("\n")
    for m in BLOCK.finditer(text):
        first = text[:m.start("body")].count("\n")
        inside.update(range(first, first + m.group("body").count("\n") + 1))
    return [i + 1 for i, line in enumerate(lines) if line.startswith("|") and i not in inside]


def apply(page_text: str, blocks: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group("name")
        return m.group(1) + (blocks[name].rstrip("\n") + "\n" if name in blocks else m.group("body")) + m.group(4)

    return BLOCK.sub(sub, page_text)


def render_docs(write: bool, notes: bool = True) -> list[str]:
    """Rewrite (or, without ``write``, compare) every page's blocks; returns the problems.
    Without ``notes``, the blocks are compared less their stale notes."""
    problems = []
    blocks = rendered_blocks(notes=notes)
    pages: dict[str, dict[str, str]] = {}
    for block, (page, text) in blocks.items():
        pages.setdefault(page, {})[block] = text
    for page, mine in sorted(pages.items()):
        path = REPO / page
        old = path.read_text()
        present = {m.group("name") for m in BLOCK.finditer(old)}
        problems += [f"{page}: has no <!-- figure: {b} --> block" for b in sorted(set(mine) - present)]
        if not notes and not write:  # (the page's notes left out of the comparison too)
            old = without_stale_notes(old)
        new = apply(old, mine)
        if new != old:
            if write:
                path.write_text(new)
            else:
                bodies = {m.group("name"): m.group("body") for m in BLOCK.finditer(old)}
                changed = sorted(b for b in mine if b in present and
                                 mine[b].rstrip("\n") != bodies[b].rstrip("\n"))
                problems.append(f"{page}: block(s) {', '.join(changed)} differ from what the raw results render "
                                f"(python benchmarks/figures.py render)")
    return problems


def check(with_staleness: bool = True) -> list[str]:
    """Everything ``make figures-check`` fails on: a missing raw file (not of a figure run by
    name only: :func:`not_measured`), its provenance or
    repeats, a block that differs from what its raw file renders (``with_staleness``: its
    stale note too, which the git history decides), a stray table. A stale figure is not a
    failure: its block says so (``list`` and ``check`` list them)."""
    problems = []
    for fig in FIGURES:
        raw = load_raw(fig)
        if raw is None and not_measured(fig) is not None:
            continue  # (its block says so; main lists it)
        if raw is None:
            problems.append(f"{fig.name}: no raw results ({fig.raw_path().relative_to(REPO)}); "
                            f"run: python benchmarks/figures.py run {fig.name}")
            continue
        problems += provenance_problems(fig, raw)
    problems += render_docs(write=False, notes=with_staleness)
    for page in sorted((REPO / "docs" / "benchmarks").glob("*.md")) + [REPO / "README.md"]:
        if page == REPO / "docs" / "benchmarks" / "README.md":
            continue  # the index of pages: no figures
        text = page.read_text()
        rows = stray_tables(text)
        if page == REPO / "README.md":  # only its "which solver when" table is a figure
            start = text.find("## Which solver when")
            end = text.find("\n## ", start + 1) if start >= 0 else -1
            first, last = text[:start].count("\n") + 1, text[:end if end >= 0 else len(text)].count("\n") + 1
            rows = [n for n in rows if start >= 0 and first <= n <= last]
        if rows:
            problems.append(f"{page.relative_to(REPO)}: a table outside a rendered block (line "
                            f"{', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''}): "
                            f"no raw results file backs it")
    return problems


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def run(names: list[str], quick: bool, stale_only: bool = False) -> int:
    """Run the figures named (none: every one but those run by name only), then render;
    ``stale_only``: only those whose raw file is missing or stale, so that a run cut short
    goes on where it stopped."""
    todo = [BY_NAME[n] for n in names] if names else FIGURES
    for fig in todo:
        if fig.needs_gpu and not _has_gpu():
            print(f"== {fig.name}: skipped: it measures a CUDA GPU and none is visible here (make gpu)", flush=True)
            continue
        if not names and fig.by_name_only and (not quick or not fig.quick):  # (no smoke run: by name only too)
            print(f"== {fig.name}: skipped: {fig.by_name_only} (figures.py run {fig.name})", flush=True)
            continue
        raw = load_raw(fig) if stale_only and not quick else None
        if raw is not None and stale(fig, raw) is None:
            print(f"== {fig.name}: current ({raw['commit'][:10]}): not run", flush=True)
            continue
        cmd = fig.command(quick)
        fig.raw_path(quick).parent.mkdir(parents=True, exist_ok=True)
        print(f"== {fig.name}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO).returncode
        if rc not in (0, 1):  # 1: the benchmark ran and a target was missed; the figure stands
            print(f"figures: {fig.name} failed (exit status {rc})", file=sys.stderr)
            return 2
    if not quick:
        render_docs(write=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run the benchmarks behind the figures, then render")
    r.add_argument("names", nargs="*", help="figures to run (default: all): " + ", ".join(BY_NAME))
    r.add_argument("--quick", action="store_true", help="a small smoke run of each (not committed)")
    r.add_argument("--stale", action="store_true", help="only those whose raw file is missing or stale")
    sub.add_parser("render", help="rewrite the docs' rendered blocks from the committed raw files")
    c = sub.add_parser("check", help="fail on a block that differs, a stale or single-run raw file, a stray table")
    c.add_argument("--no-staleness", action="store_true",
                   help="compare the blocks less their stale notes, and list no stale figure (no git history needed)")
    sub.add_parser("list", help="the figures, their commands and sources")
    args = p.parse_args(argv)
    if args.what == "run":
        bad = [n for n in args.names if n not in BY_NAME]
        if bad:
            p.error(f"unknown figure(s) {', '.join(bad)}; known: {', '.join(BY_NAME)}")
        return run(args.names, args.quick, args.stale)
    if args.what == "render":
        problems = render_docs(write=True)
        for line in problems:
            print(f"figures: {line}", file=sys.stderr)
        return 1 if problems else 0
    if args.what == "list":
        for fig in FIGURES:
            raw = load_raw(fig)
            state = "no raw results" if raw is None else (stale(fig, raw) or f"current ({raw['commit'][:10]})")
            print(f"{fig.name}: {' '.join(fig.command()[1:])}\n    page {fig.page}; {state}")
        return 0
    problems = check(with_staleness=not args.no_staleness)
    if not args.no_staleness:
        for fig in FIGURES:
            raw = load_raw(fig)
            why = stale(fig, raw) if raw is not None else None
            if why:
                print(f"figures-check: stale (its block says so; figures.py run --stale): {fig.name}: {why}")
            if raw is None and not_measured(fig) is not None:
                print(f"figures-check: not measured yet (its block says so; figures.py run {fig.name}): {fig.name}")
    for line in problems:
        print(f"figures-check: {line}")
    print(f"figures-check: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
