"""``distsync``: argument parsing, progress bars and tables; nothing else."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from distsync import __version__
from distsync.errors import ConfigError, DistsyncError, Interrupted, exit_code
from distsync.experiments.auto import AUTO, RECORD as AUTO_RECORD, WINNER as AUTO_WINNER

console = Console(stderr=True)


def _stdout() -> Console:
    # Tables stay readable when piped (rich assumes 80 columns off a terminal), unless the
    # COLUMNS variable says how wide.
    out = Console()
    return out if out.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(width=120)


def _show(table: Table, out: Console | None = None) -> None:
    """``table`` on ``out`` (stdout) where it fits the console's width; where it does not (a
    narrow terminal), each row as a block, its first cell then ``  header: cell`` lines, so
    that no figure is cut short to "…"."""
    out = out or _stdout()
    if Measurement.get(out, out.options.update_width(10**5), table).maximum <= out.width:
        out.print(table)
        return
    flat = [str(c.header).replace("/\n", "/").replace("\n", " ") for c in table.columns]
    cells = [[str(cell).replace("\n", " ") for cell in column.cells] for column in table.columns]
    if table.title:
        out.print(str(table.title), highlight=False, markup=False)
    for i in range(table.row_count):
        out.print(cells[0][i], style="bold", highlight=False, markup=False)
        for head, column in zip(flat[1:], cells[1:]):
            out.print(f"  {head}: {column[i]}", highlight=False, markup=False)
    if table.caption:
        out.print(str(table.caption), highlight=False, markup=False)


def _one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped, as ``repr`` would:
    a message may quote the user's input (argparse's "unrecognized arguments: ..." does,
    verbatim), and the promise is one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"distsync: error: {_one_line(message)} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="distsync", description="Train PyTorch models with distributed synchronization solvers and compare them.")
    p.add_argument("--version", action="version", version=f"distsync {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run_commands(sub)
    _add_sim_commands(sub)
    sub.add_parser("list", help="list solvers and workloads")
    return p


def _add_run_commands(sub) -> None:
    """train, compare, linktest, crossover: real runs."""
    from distsync.options import add_run_options, finite_float

    t = sub.add_parser("train", help="train with one solver")
    t.add_argument("--solver", default="allreduce",
                   help="solver name (see `distsync list`), path/to/file.py:Class, or auto: short real runs of the "
                        "simulator's fastest candidates choose it, and the winner trains on (docs/auto.md)")
    t.add_argument("--explore", type=finite_float, metavar="SHARE",
                   help="--solver auto: the share of the job's budget its short runs may spend (default: 0.1)")
    t.add_argument("--candidates", metavar="SOLVERS",
                   help="--solver auto: choose among these solvers' option sets only (comma-separated)")
    t.add_argument("--solver-option", "-o", action="append", metavar="KEY=VALUE", help="a solver option, repeatable")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last complete checkpoint, with its own config.json; "
                        "--steps, --epochs, --budget, --eval-every, --timeout, --max-restarts and --fault given here "
                        "apply, other options that differ from the run's are refused")
    add_run_options(t)

    c = sub.add_parser("compare", help="run several solvers on the same work and write a report")
    c.add_argument("--solvers", default="allreduce,ddp", help="comma-separated solver names (default: allreduce,ddp)")
    c.add_argument("--solver-option", "-o", action="append", metavar="[SOLVER.]KEY=VALUE",
                   help="a solver option; with SOLVER. for one solver only; repeatable")
    c.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every solver N times, with seeds --seed, --seed+1, ...; the table shows each figure's "
                        "median and range and marks differences within that spread (default: 1)")
    add_run_options(c)

    lt = sub.add_parser("linktest", help="measure the bandwidth the (emulated) links deliver")
    lt.add_argument("--link", metavar="BANDWIDTH[,LATENCY]", help="emulated link (default: loopback, unshaped)")
    lt.add_argument("--workers", type=int, default=2)
    lt.add_argument("--sizes", default="1,10", help="message sizes in MiB, comma-separated (default: 1,10)")
    lt.add_argument("--repeats", type=int, default=3)
    lt.add_argument("--timeout", type=finite_float, default=60.0, dest="timeout_s")
    lt.add_argument("--out", help="run folder (default: runs/<time>-linktest)")

    x = sub.add_parser("crossover", help="run several jobs on the same workers: crossover against sequential and naive")
    x.add_argument("jobs", metavar="JOBS.toml", help="a [crossover] table and [[job]] tables (see docs/crossover.md)")
    x.add_argument("--policy", help="alternate | fcfs (default: the file's, else alternate)")
    x.add_argument("--modes", help="comma-separated, of crossover, sequential, naive (default: all three)")
    x.add_argument("--workers", type=int, help="workers (devices) every job runs on (default: the file's, else 2)")
    x.add_argument("--link", metavar="BANDWIDTH[,LATENCY]", help="emulated link of every device (needs root)")
    x.add_argument("--out", help="output folder (default: the file's, else runs/<time>-crossover)")

    for sp in (t, c):
        g = sp.add_argument_group("solver options (shortcuts for -o KEY=VALUE)")
        for flag, help_text in SHORTCUTS.items():
            g.add_argument(f"--{flag.replace('_', '-')}", dest=f"opt_{flag}", metavar="VALUE", help=help_text)


def _add_sim_commands(sub) -> None:
    """simulate, sweep, recommend: the simulator."""
    from distsync.options import add_training_options, finite_float

    training = "how the model trains, as `distsync train` takes it"

    sm = sub.add_parser("simulate", help="simulate solvers on many virtual workers (timing), or a real run")
    sm.add_argument("--solvers", default="allreduce", help="comma-separated solver names (default: allreduce)")
    sm.add_argument("--solver-option", "-o", action="append", metavar="[SOLVER.]KEY=VALUE",
                    help="a solver option; with SOLVER. for one solver only; repeatable")
    sm.add_argument("--workers", type=int, default=8)
    sm.add_argument("--steps", type=int, default=100, help="steps per worker (default: 100)")
    sm.add_argument("--budget", metavar="KIND[=VALUE][,...]",
                    help="a budget for the job as a whole, as `distsync train` takes it: samples=N, seconds=S (of "
                         "virtual time), target or target=VALUE (train mode); each worker at its own pace, the job "
                         "stopping where a real run with that budget stops (--steps: the first guess, or with a "
                         "target alone, a tenth of the cap)")
    sm.add_argument("--compute-ms", type=finite_float, default=10.0, help="a normal worker's compute per step (default: 10)")
    sm.add_argument("--model-mb", type=finite_float, help="model size in MB (default: the --workload's)")
    sm.add_argument("--workload", default="digits", help="whose model size to use (default: digits)")
    sm.add_argument("--link", default="1gbit", metavar="BANDWIDTH[,LATENCY]", help="every host's link (default: 1gbit)")
    sm.add_argument("--per-node", type=int, default=1, help="workers per node (default: 1)")
    sm.add_argument("--intra-link", metavar="BANDWIDTH[,LATENCY]", help="link inside a node (default: --link)")
    sm.add_argument("--algorithm", default="ring", help="all-reduce algorithm: ring | tree (default: ring)")
    sm.add_argument("--slow", metavar="RANK:FACTOR[,...]", help="these workers compute FACTOR times slower")
    sm.add_argument("--slow-fraction", type=finite_float, default=0.0, help="share of workers (drawn from the seed) that are slow")
    sm.add_argument("--slow-factor", type=finite_float, default=3.0, help="how much slower they are (default: 3)")
    sm.add_argument("--jitter", type=finite_float, default=0.0, help="random per-step extra compute, up to this share of the worker's own step")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--mode", default="timing", help="timing (no math) | train (real rules on stacked replicas of "
                                                     "the --workload's model; metric against virtual time)")
    add_training_options(sm.add_argument_group(f"{training} (train mode follows it; timing takes the batch size)"))
    sm.add_argument("--calibrate", metavar="RUN_DIR", help="simulate this real run and compare with what it measured")
    sm.add_argument("--fit-from", metavar="RUN_DIR",
                    help="with --calibrate: fit compute and per-message cost on this other run (out of sample)")
    sm.add_argument("--host-cores", type=int, metavar="N",
                    help="with --calibrate: the runs shared N cores of one machine (emulated devices, unshaped "
                         "links); the per-message cost then grows with the processes per core")
    sm.add_argument("--json", action="store_true", help="print the results as JSON")

    _add_recommend_command(sub, training)

    sw = sub.add_parser("sweep", help="simulate a grid of workers x computation/communication x slow share")
    sw.add_argument("--solvers", default="allreduce,ripples,ad-psgd,local",
                    help="solvers with a train mode (default: allreduce,ripples,ad-psgd,local)")
    sw.add_argument("--workers", default="4,16,64", help="comma-separated worker counts (default: 4,16,64)")
    sw.add_argument("--ratios", default="0.3,1,3", help="computation/communication ratios (default: 0.3,1,3)")
    sw.add_argument("--slow-shares", default="0,0.1,0.3", help="shares of 3x slow workers (default: 0,0.1,0.3)")
    sw.add_argument("--solver-option", "-o", action="append", metavar="[SOLVER.]KEY=VALUE",
                    help="a solver option; with SOLVER. for one solver only; servers=workers/K: per worker count")
    sw.add_argument("--workload", default="digits")
    sw.add_argument("--steps", type=int, default=300)
    add_training_options(sw.add_argument_group(f"{training} (train mode follows it)"),
                         defaults={"batch_size": 8, "eval_every": 10})
    sw.add_argument("--out", help="output folder (default: runs/<time>-sweep)")


def _add_recommend_command(sub, training: str) -> None:
    """recommend: which solver for this model on that cluster."""
    from distsync.options import add_training_options, finite_float

    rc = sub.add_parser("recommend", help="which solver, with which options, for this model on that cluster")
    rc.add_argument("--workload", default="digits", help="built-in name or path/to/file.py:make_workload")
    rc.add_argument("--workers", type=int, default=8, help="workers of the cluster (default: 8)")
    rc.add_argument("--link", default="10gbit", metavar="BANDWIDTH[,LATENCY]", help="every host's link (default: 10gbit)")
    rc.add_argument("--slow-fraction", type=finite_float, default=0.0, help="share of the workers that are slow")
    rc.add_argument("--slow-factor", type=finite_float, default=3.0, help="how much slower they are (default: 3)")
    rc.add_argument("--jitter", type=finite_float, default=0.0, help="random per-step extra compute, up to this share of the worker's own step")
    rc.add_argument("--device-ms", type=finite_float, help="a step's compute on your device (default: measured here)")
    rc.add_argument("--per-message-ms", type=finite_float, default=0.0,
                    help="what each message costs beyond the link's latency (default: 0)")
    rc.add_argument("--fit-from", metavar="RUN_DIR",
                    help="a real run of this workload: fit the per-message cost (and, without --device-ms, the "
                         "compute per step) on it")
    rc.add_argument("--solvers", help="comma-separated solvers to consider (default: every solver)")
    rc.add_argument("--seed", type=int, default=0)
    rc.add_argument("--budget", metavar="target[=VALUE]",
                    help="the target time to target is predicted for: target (the workload's, the default) or "
                         "target=VALUE; the printed commands carry it")
    rc.add_argument("--verify", type=int, default=0, metavar="K",
                    help="run the top K (and allreduce) for real on this machine's emulated devices")
    rc.add_argument("--time-budget", type=finite_float, default=60.0, metavar="S", help="seconds spent on the "
                    "answer (default: 60); what train mode does not reach is judged by its timing, said so")
    rc.add_argument("--search", choices=("staged", "full"), default="staged",
                    help="staged (the default): every candidate trained for a short horizon, the best third "
                         "for a longer one, twice, the rest to the target; full: every candidate to the target, "
                         "the fastest first, while the time budget lasts")
    rc.add_argument("--verify-seconds", type=finite_float, default=60.0, metavar="S",
                    help="with --verify: each run stops at its target or after S seconds of training (default: 60)")
    rc.add_argument("--verify-budget", type=finite_float, default=300.0, metavar="SECONDS",
                    help="with --verify: the seconds all its runs take, predictions included; a run with no room left "
                         "is not run, and said so (default: 300)")
    add_training_options(rc.add_argument_group(f"{training} (train mode follows it; so do the printed commands)"))
    rc.add_argument("--out", help="output folder (default: runs/<time>-recommend-<workload>)")


SHORTCUTS = {
    "servers": "parameter servers to shard the center over (parameter-server and elastic solvers)",
    "threads": "Hogwild training threads per worker (hogwild, ea-wild)",
    "group_size": "workers per Partial All-Reduce (ripples)",
    "schedule": "static | random | smart (ripples)",
    "tau": "steps between elastic exchanges (elastic solvers)",
}


def _typed(argv: list[str]) -> dict[str, str]:
    """The options ``argv`` sets itself, ``{dest: flag}``: what argparse fills in by default
    is no choice of the user's."""
    parser, flags = _build_parser(), {}

    def no_defaults(p: argparse.ArgumentParser) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    no_defaults(sp)
            elif a.option_strings:
                a.default = argparse.SUPPRESS
                flags[a.dest] = max(a.option_strings, key=len)

    no_defaults(parser)
    return {d: flags[d] for d in vars(parser.parse_args(argv)) if d in flags}


#: the RunConfig field each option of train sets, where the names differ
_FIELD_OF = {"workload_option": "workload_options", "rows": "workload_options", "solver_option": "solver_options",
             **{f"opt_{k}": "solver_options" for k in SHORTCUTS}}


def _resume(args: argparse.Namespace) -> Any:
    """``train --resume``: the run, with the options typed here that may change it, and one
    line on what they changed; the others refused (:func:`~distsync.runtime.launch.resume_run`)."""
    from distsync.config import RunConfig, parse_key_values
    from distsync.options import config_from_args
    from distsync.runtime.launch import resume_run

    typed = _typed(args.argv)
    built = config_from_args(args, args.solver, parse_key_values(_solver_option_items(args)))
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    given, flags = {}, {}
    for dest, flag in typed.items():
        name = _FIELD_OF.get(dest, dest)
        if name in fields and name != "resume":
            given[name] = getattr(built, name)
            flags.setdefault(name, flag)
    run, changed = resume_run(Path(args.resume), given, flags)
    if changed:
        console.print(f"distsync: resuming with {changed}", markup=False, highlight=False, soft_wrap=True)
    return run


def _solver_option_items(args: argparse.Namespace) -> list[str]:
    """-o items, with the shortcut flags added as KEY=VALUE."""
    items = list(args.solver_option or [])
    for key in SHORTCUTS:
        value = getattr(args, f"opt_{key}", None)
        if value is not None:
            items.append(f"{key}={value}")
    return items


def _log_lines(what: str) -> Callable[[str, int, int], None]:
    """Off a terminal (a log, CI, a pipe), where no bar is drawn: a line on stderr as each
    stage or candidate starts, ``distsync: WHAT: DONE/TOTAL LABEL (N s)``, so that a long run's
    log shows it is alive; on a terminal, nothing (the bar says it)."""
    t0, last = time.monotonic(), [None]

    def say(label: str, done: int, total: int) -> None:
        if console.is_terminal or (label, done) == last[0]:
            return
        last[0] = (label, done)
        count = f"{done}/{total} " if total else ""  # (a stage with no count of its own: its label alone)
        console.print(f"distsync: {what}: {count}{label} ({time.monotonic() - t0:.0f} s)", markup=False,
                      highlight=False, soft_wrap=True)

    return say


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.fields[where]}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        # Off a terminal (logs, CI, pipes) a bar is noise: the final table says it all.
        disable=not console.is_terminal,
    )


def _comparison_table(groups: list[dict[str, Any]]) -> Table:
    """compare's table: single runs as train shows them; repeats with each figure's spread."""
    from distsync.experiments.report import SPREAD_MARK, comparison_table

    headers, rows = comparison_table(groups, two_lines=True)
    n = max(g["repeats"] for g in groups)
    first = groups[0]["summaries"][0]
    title = f"{first['workload']}, {first['workers']} workers"
    caption = None
    if n > 1:
        title += f": median (min..max) of {n} repeats"
        if len(groups) > 1:
            caption = f"{SPREAD_MARK} within the spread of {n} repeats: the range overlaps {groups[0]['label']}'s"
    table = Table(title=title, caption=caption)
    for h in headers:
        if n > 1:  # (each range on a line of its own under its median: long headers take two too)
            h = {"to target (s)": "to target\n(s)", "steps/worker": "steps/\nworker", "MiB sent": "MiB\nsent"}.get(h, h)
        table.add_column(h, justify="left" if h == "solver" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def _run_with_progress(run, every_s: float = 5.0) -> Any:
    """A progress bar on a terminal; off one (logs, CI, pipes), a plain line per run at most
    every ``every_s`` seconds (``--progress-every``; 0: none)."""
    plain = not console.is_terminal
    with _progress() as bar:
        tasks, last, began = {}, {}, {}

        def on_start(name: str, cfg) -> None:
            total = cfg.steps if cfg.budget is None else None  # a budget: it ends when it is spent
            tasks[name] = bar.add_task(name, total=total, status="starting", where="")
            began[name], last[name] = time.monotonic(), time.monotonic()

        def on_progress(name: str, data: dict[str, Any]) -> None:
            now = time.monotonic()
            if "phase" in data:  # start-up, before the first step: each phase said as it begins
                bar.update(tasks[name], status=data["phase"])
                if plain and every_s > 0:
                    console.print(f"{name}: {data['phase']} ({now - began.get(name, now):.0f} s)", highlight=False,
                                  soft_wrap=True)
                return
            status = f"loss {data['loss']:.4f}"
            if data.get("metric") is not None:
                status += f"  metric {data['metric']:.4f}"
            where = f"step {data['step']:>5}" + (f"/{data['steps']}" if data.get("steps") else "")
            bar.update(tasks[name], completed=data["step"], status=status, where=where)
            if plain and every_s > 0 and now - last.get(name, 0.0) >= every_s:
                last[name] = now
                steps = f"/{data['steps']}" if data.get("steps") else ""
                console.print(f"{name}: step {data['step']}{steps}  {status}  ({now - began.get(name, now):.0f} s)",
                              highlight=False, soft_wrap=True)

        return run(on_start, on_progress)


def _cmd_train(args: argparse.Namespace) -> int:
    from distsync.config import parse_key_values
    from distsync.options import config_from_args
    from distsync.runtime.resolve import resolve, run_notes
    from distsync.runtime.launch import launch
    from distsync.runtime.run_folder import train_folder

    if args.solver != AUTO and (args.explore is not None or args.candidates is not None):
        raise ConfigError(f"{'--explore' if args.explore is not None else '--candidates'} goes with --solver auto")
    if args.resume and (Path(args.resume) / AUTO_RECORD).is_file():  # (an auto run: its winner goes on)
        args.resume = str(Path(args.resume) / AUTO_WINNER)
    elif args.solver == AUTO and not args.resume:
        return _cmd_auto(args)
    if args.resume:
        run = _resume(args)
        cfg = run.config
    else:
        cfg = config_from_args(args, args.solver, parse_key_values(_solver_option_items(args)))
        run = resolve(cfg)
    out = train_folder(run.config.out, cfg.workload, cfg.solver, resuming=bool(args.resume), overwrite=args.overwrite)
    for line in run_notes(run):
        console.print(f"note: {line}", markup=False, highlight=False, soft_wrap=True)

    def start(on_start, on_progress):
        on_start(cfg.solver, run.config)
        return launch(run, out, lambda d: on_progress(cfg.solver, d))

    summary = _run_with_progress(start, args.progress_every)
    _show(_comparison_table([{"summaries": [summary], "repeats": 1}]))  # (compare's, for one run)
    _print_device(summary)
    _print_recovery(summary, run.config.checkpoint_every.steps if run.config.checkpoint_every else None)
    _print_not_learned(summary, run.config)
    console.print(f"run folder: {out}")
    return 0


def _cmd_auto(args: argparse.Namespace) -> int:
    """``train --solver auto`` (:mod:`distsync.experiments.auto`)."""
    from distsync.config import parse_key_values
    from distsync.experiments.auto import EXPLORE, run_auto
    from distsync.options import config_from_args
    from distsync.runtime.launch import launch
    from distsync.runtime.run_folder import train_folder

    cfg = config_from_args(args, AUTO, parse_key_values(_solver_option_items(args)))
    out = train_folder(cfg.out, cfg.workload, AUTO, resuming=False, overwrite=args.overwrite)
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None

    def launch_one(job, run_dir: Path) -> dict[str, Any]:
        def start(on_start, on_progress):
            on_start(job.solver, job)
            return launch(job, run_dir, lambda d: on_progress(job.solver, d))

        return _run_with_progress(start, args.progress_every)

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    summary = run_auto(cfg, out, launch_one, explore=EXPLORE if args.explore is None else args.explore,
                       candidates=candidates, say=say)
    _show(_comparison_table([{"summaries": [summary], "repeats": 1}]))
    record = summary["auto"]
    reached = record["final"].get("time_to_target_s")
    _stdout().print(f"the whole job (wall, to target): the short runs' {record['stage2_training_s']:.1f} s of "
                    f"training counted; the winner's own run: {record['final']['wall_time_s']:.1f} s"
                    + (f", the target after {reached:.1f} s" if reached is not None else ""),
                    markup=False, highlight=False, soft_wrap=True)
    _print_device(summary)
    _print_not_learned(summary, cfg)
    console.print(f"run folder: {out} (the winner's: {out / AUTO_WINNER}; the choice: {out / 'report.md'})")
    return 0


def _print_not_learned(summary: dict[str, Any], cfg: Any) -> None:
    """A line when the run did not learn (its metric, in its direction, at the last evaluation
    no more than 1% better than at the first, and the target never reached); or, when it
    learned but its evaluation loss ended above the first evaluation's, a line that says so
    without calling it a failure."""
    metric, target = summary.get("metric") or "metric", summary.get("target")
    aim = f" (target {target:g})" if target is not None else ""
    if summary.get("eval_loss_rose"):
        console.print(f"note: the evaluation loss rose from {summary['first_loss']:.4g} to {summary['final_loss']:.4g} "
                      f"while {metric} went from {summary['first_metric']:.4g} to {summary['final_metric']:.4g}{aim}: "
                      f"overfitting or overconfidence, not a failure to learn", highlight=False)
        return
    if not summary.get("did_not_learn"):
        return
    stale = (summary.get("staleness") or {}).get("mean")
    lr = "the workload's" if cfg.lr is None else f"{cfg.lr:g}"
    console.print(f"note: this run did not learn: its {metric} went from {summary['first_metric']:.4g} at the first "
                  f"evaluation to {summary['final_metric']:.4g}{aim}. Check --lr (now {lr}): too high a rate"
                  + (f" for gradients {stale:.1f} server updates stale on average" if stale else "")
                  + " stalls a run at chance; too low a one never moves it", highlight=False)  # (wrapped between words)


def _print_device(summary: dict[str, Any], which: str = "") -> None:
    """A CPU-bound run with an emulated device says so (``which``: the repeat, in compare)."""
    from distsync.metrics import device_warning

    warning = device_warning(summary.get("device"))
    if warning:
        console.print(f"[yellow]{summary['label']}{which}: {warning}[/]", highlight=False)  # (wrapped between words)


def _took(seconds: float) -> str:
    """A recovery's duration as the console says it: ``26 ms``, ``4.1 s``."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _restarted(f: dict[str, Any], every: int | None) -> str:
    """How a restart went: from which step, the steps lost and the time to recover; and why,
    when more than the checkpoint interval (``every`` steps) was lost."""
    why = (f"; more than the {every}-step interval: a slower worker had not written a newer checkpoint, "
           "each rank's log names it" if every and f["steps_lost"] > every else "")
    return (f"restarted from step {f['resumed_from_step']} ({f['steps_lost']} steps lost, {f['recovery_s']:.1f} s "
            f"to recover{why})")


def _print_recovery(summary: dict[str, Any], every: int | None = None) -> None:
    """One line per death the run survived or restarted on (workers dropped, servers and
    coordinators replaced), and per injected kill that restarted the job (``every``: the
    checkpoint interval in steps, if it is one)."""
    from distsync.runtime.fault_match import worker_deaths

    rec = summary.get("recovery") or {}
    for d, taken_over, f in worker_deaths(rec):
        if f and "went_on_s" in f and "live_workers" in f:
            how = (f"; the other {f['live_workers']} re-formed their group without it in {_took(f['went_on_s'])} "
                   f"and trained on")
        elif f and "went_on_s" in f:  # (no group to re-form: a survivor's step without it)
            how = f"; the other workers went on in {_took(f['went_on_s'])}"
        elif f and "resumed_from_step" in f:  # (the workers' logs say why)
            how = f", but the others failed to go on without it: the job {_restarted(f, every)}"
        else:
            how = "; the other workers trained on"
        if f and f.get("replaced"):
            done = (f" (after step {f['joined_at_step'] - 1}, which the servers had applied before the dead one's "
                    f"journal had it)" if f.get("unrecorded_steps") else "")
            how += (f"; a replacement joined at step {f['joined_at_step']}{done}, "
                    f"{f['healed_s']:.1f} s after the death, "
                    + (f"with rank {f['healed_from']}'s state" if f["healed_from"] >= 0 else "served on by the servers"))
        elif d.get("replacement") and not taken_over:  # (its mark went back: the replacement came too late)
            how += "; its replacement came after the others had finished training"
        elif taken_over:  # (a replacement took its place but is not seen training)
            how += "; a replacement took its place"
        if d["signal"] == "stalled":  # (its row's times count from its last progress: the others' wait included)
            since = "its last exchange with its peers" if f and f.get("stalled_from") == "exchange" else \
                "it stopped making progress"
            stalled = f" {f['stalled_s']:.1f} s after {since}" if f and "stalled_s" in f else ""
            what = f"stalled after step {d.get('last_step')} and was dropped{stalled}"
        else:
            what = f"died ({d['signal']}) after step {d.get('last_step')} and was dropped"
        console.print(f"worker rank {d['rank']} {what}{how}", highlight=False, soft_wrap=True)
    for f in rec.get("faults", []):
        if "dead_at" in f:  # a server's or coordinator's death
            what = f"{f['role']} rank {f['rank']} died ({f.get('cause')}) at step {f['step']}"
            if f.get("replaced") and "healed_s" in f:
                how = f" and was replaced in {_took(f['healed_s'])}; training went on"
            elif f.get("replaced"):
                how = "; a replacement was started and training went on" if "went_on_s" in f else \
                    "; a replacement was started"
            elif "resumed_from_step" in f:
                how = f": the job {_restarted(f, every)}"
            else:
                how = ": the job did not go on"
            console.print(what + how, highlight=False, soft_wrap=True)
        elif "resumed_from_step" in f and not f.get("dropped"):
            console.print(f"{f['role']} rank {f['rank']} was killed at step {f['step']}: {_restarted(f, every)}",
                          highlight=False, soft_wrap=True)


def _cmd_compare(args: argparse.Namespace) -> int:
    from distsync.config import parse_key_values
    from distsync.experiments.compare import check_repeats, compare, fixed_steps_note, resolve_comparison
    from distsync.options import config_from_args
    from distsync.runtime.resolve import run_notes
    from distsync.runtime.run_folder import compare_folder

    solvers = [s.strip() for s in args.solvers.split(",") if s.strip()]
    runs = resolve_comparison(config_from_args(args, "allreduce", {}), solvers,
                              parse_key_values(_solver_option_items(args)))
    base = runs[0].config
    check_repeats(args.repeats, base.seed)
    out = compare_folder(base.out, base.workload, solvers, args.overwrite)
    for line in dict.fromkeys(line for run in runs for line in run_notes(run)):
        console.print(f"note: {line}", markup=False, highlight=False, soft_wrap=True)
    groups = _run_with_progress(
        lambda on_start, on_progress: compare(runs, out, on_start, on_progress, repeats=args.repeats),
        args.progress_every)
    _show(_comparison_table(groups))
    for g in groups:
        for k, summary in enumerate(g["summaries"]):
            _print_device(summary, f" (repeat {k}, seed {g['seeds'][k]})" if g["repeats"] > 1 else "")
    if len(groups) > 1:
        from distsync.experiments.report import conclusion

        _stdout().print(conclusion(groups), highlight=False)  # (wrapped between words)
    note = fixed_steps_note(base)
    if note:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"report: {out / 'report.md'}")
    return 0


def _numbers(text: str, what: str, kind=float) -> list:
    """``1,10`` as numbers; an empty or garbled list is a one-line error."""
    from distsync.errors import ConfigError

    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"bad --{what} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise ConfigError(f"--{what} is empty")
    return values


def _cmd_linktest(args: argparse.Namespace) -> int:
    from distsync.config import format_rate
    from distsync.runtime.linktest import linktest
    from distsync.runtime.run_folder import out_or_default

    out = out_or_default(args.out, "linktest")
    result = linktest(args.workers, args.link, _numbers(args.sizes, "sizes"), args.repeats, args.timeout_s, out)
    rate = result["configured_bps"]
    table = Table(title=f"linktest: {args.workers} workers, link {args.link or 'loopback (unshaped)'}")
    for h in ("size (MiB)", "p2p (Mbit/s)", "all-reduce bus (Mbit/s)", "configured (Mbit/s)", "p2p / link", "all-reduce / link"):
        table.add_column(h, justify="right", no_wrap=True)
    for r in result["rows"]:
        share = (lambda v: f"{v / rate:.0%}") if rate else (lambda v: "-")
        table.add_row(f"{r['size_mb']:g}", f"{r['p2p_bps'] / 1e6:,.1f}", f"{r['allreduce_bus_bps'] / 1e6:,.1f}",
                      f"{rate / 1e6:,.1f}" if rate else "-", share(r["p2p_bps"]), share(r["allreduce_bus_bps"]))
    _show(table)
    if result["partial_group"]:
        group = Table(title=f"Partial All-Reduce of {result['partial_group']} workers (Ripples' group), against "
                            f"the all-reduce of all {args.workers}")
        from distsync.comm import PARTIAL_REDUCES as reduces
        for h in ("size (MiB)", "all-reduce (ms)", *(f"{how} (ms, x all-reduce)" for how in reduces)):
            group.add_column(h, justify="right", no_wrap=True)
        for r in result["rows"]:
            group.add_row(f"{r['size_mb']:g}", f"{r['allreduce_s'] * 1e3:,.2f}",
                          *(f"{r[f'partial_{how}_s'] * 1e3:,.2f} ({r[f'partial_{how}_vs_allreduce']:.2f}x)"
                            for how in reduces))
        _show(group)
    if rate:
        console.print(f"configured {format_rate(rate)} per host and direction (latency: {result['latency_mode']})")
    console.print(f"run folder: {out}")
    return 0


def _cmd_crossover(args: argparse.Namespace) -> int:
    from distsync.experiments.crossover import load_plan, run_crossover
    from distsync.runtime.run_folder import crossover_folder

    plan = load_plan(Path(args.jobs), {"policy": args.policy, "modes": args.modes, "workers": args.workers,
                                       "link": args.link, "out": args.out})
    plan.out = crossover_folder(plan.out, args.out)
    names = [j.name for j in plan.jobs]

    def finished(mode: str, job: str) -> None:
        console.print(f"{mode}: job {job} finished", highlight=False)

    result = run_crossover(plan, finished)
    table = Table(title=f"crossover: {len(names)} jobs on {plan.workers} workers, policy {plan.policy}, "
                        f"link {plan.link or 'unshaped'}")
    for h in ["mode", "makespan (s)", "vs sequential"] + [f"{n} samples/s" for n in names] + ["max token wait (s)"]:
        table.add_column(h, justify="left" if h == "mode" else "right", no_wrap=True)
    seq = result["modes"].get("sequential", {}).get("makespan_s")
    for mode, m in result["modes"].items():
        waits = [r.get("token", {}).get("max_wait_s") for r in m["jobs"].values()]
        waits = [w for w in waits if w is not None]
        table.add_row(mode, f"{m['makespan_s']:.2f}", f"{m['makespan_s'] / seq:.2f}x" if seq else "-",
                      *[f"{m['jobs'][n]['throughput_samples_per_s']:,.0f}" for n in names],
                      f"{max(waits):.3f}" if waits else "-")
    _show(table)
    console.print(f"report: {Path(plan.out) / 'report.md'}")
    return 0


def _print_calibration(r: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    table = Table(title=f"simulated vs measured: {r['solver']} on {r['workload']}, {r['workers']} workers, "
                        f"link {r['link']}")
    for h in ("", "throughput (samples/s)", "time to target (s)"):
        table.add_column(h, justify="right")
    fmt = lambda v: "n/a" if v is None else f"{v:,.2f}"  # noqa: E731
    table.add_row("measured", f"{r['measured_throughput']:,.0f}", fmt(r["measured_time_to_target_s"]))
    table.add_row("simulated", f"{r['predicted_throughput']:,.0f}", fmt(r["predicted_time_to_target_s"]))
    table.add_row("error", f"{r['throughput_error']:+.1%}", "")
    _show(table)
    fitted = f"fitted on {r['fitted_on']} (out of sample)" if r["out_of_sample"] else "fitted on this run itself"
    console.print(f"compute per step {r['compute_per_step_s'] * 1e3:.2f} ms, per-message cost "
                  f"{r['fitted_latency_s'] * 1e6:.0f} us, {fitted}; model {r['model_bytes'] / 1e6:.3f} MB")


def _cmd_simulate(args: argparse.Namespace) -> int:
    from distsync.config import parse_key_values
    from distsync.experiments import split_solver_options
    from distsync.errors import ConfigError
    from distsync.sim import calibrate
    from distsync.sim.scenario import Scenario, scenario_fields, simulate_scenario

    if args.calibrate:
        if args.host_cores is not None and args.host_cores < 1:
            raise ConfigError(f"--host-cores must be >= 1, got {args.host_cores}")
        _print_calibration(calibrate(Path(args.calibrate), fit_from=Path(args.fit_from) if args.fit_from else None,
                                     host_cores=args.host_cores),
                           args.json)
        return 0
    from distsync.options import TRAINING_FIELDS, training_from_args

    scenario = Scenario(**{name: getattr(args, name) for name in scenario_fields() if name not in TRAINING_FIELDS},
                        **training_from_args(args))
    budget = scenario.budget
    if budget is not None and budget.target and scenario.mode != "train" and budget.limited:
        raise ConfigError(f"--budget {budget.text}: timing mode has no metric, so it cannot tell when the target is "
                          f"reached and would drop it: add --mode train to predict it, or leave target out")
    solvers = [s.strip() for s in args.solvers.split(",") if s.strip()]
    results = simulate_scenario(scenario, solvers, split_solver_options(solvers, parse_key_values(args.solver_option)),
                                on_solver=_log_lines("simulate"))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    table = Table(title=f"simulated: {args.workers} workers, {args.compute_ms:g} ms compute per step, "
                        f"model {scenario.model_bytes() / 1e6:.3g} MB, link {args.link}")
    heads = ["solver", "samples/s", "virtual wall (s)", "compute/comm/wait", "staleness (mean)", "syncs/step"]
    if args.mode == "train":
        heads += ["final metric", "to target (virtual s)"]
    for h in heads + ["took (s)"]:
        table.add_column(h, justify="left" if h == "solver" else "right", no_wrap=True)
    for r in results:
        sh = r["phase_share"]
        extra = []
        if args.mode == "train":
            ttt = r["time_to_target_s"]
            extra = [f"{r['final_metric']:.4f}", "n/a" if ttt is None else f"{ttt:.3f}"]
        table.add_row(r["solver"], f"{r['throughput_samples_per_s']:,.0f}", f"{r['wall_time_s']:.3f}",
                      f"{sh['compute']:.0%}/{sh['comm']:.0%}/{sh['wait']:.0%}",
                      f"{r['staleness']['mean']:.2f}" if "staleness" in r else "-",
                      f"{r['syncs_per_step']:.2f}" if "syncs_per_step" in r else "-", *extra,
                      f"{r['sim_seconds']:.2f}")
    _show(table)
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from distsync.config import parse_key_values
    from distsync.experiments import split_solver_options
    from distsync.options import training_from_args
    from distsync.runtime.run_folder import out_or_default
    from distsync.sim.sweep import run_sweep, winners

    workers = _numbers(args.workers, "workers", int)
    ratios = _numbers(args.ratios, "ratios")
    shares = _numbers(args.slow_shares, "slow-shares")
    out = out_or_default(args.out, "sweep")
    solvers = [s.strip() for s in args.solvers.split(",") if s.strip()]
    options = split_solver_options(solvers, parse_key_values(args.solver_option))
    training = training_from_args(args)
    rows = run_sweep(solvers, workers, ratios, shares, workload=args.workload, steps=args.steps,
                     batch_size=training.pop("batch_size"), eval_every=training.pop("eval_every"), out=out,
                     options=options, training=training)
    table = Table(title=f"time to target (virtual s), {args.workload}, no slow workers, "
                        f"computation/communication {ratios[len(ratios) // 2]:g}")
    table.add_column("solver")
    for n in workers:
        table.add_column(f"{n} workers", justify="right")
    for s in solvers:
        cells = []
        for n in workers:
            r = next(r for r in rows if r["solver"] == s and r["workers"] == n and r["ratio"] == ratios[len(ratios) // 2]
                     and r["slow_share"] == shares[0])
            cells.append("not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.3f}")
        table.add_row(s, *cells)
    _show(table)
    win = winners(rows, workers[-1])
    table = Table(title=f"fastest to target at {workers[-1]} workers")
    table.add_column("slow share \\ comp/comm")
    for r in ratios:
        table.add_column(f"{r:g}", justify="center")
    for sh in shares:
        table.add_row(f"{sh:.0%}", *[win.get((r, sh)) or "none" for r in ratios])
    _show(table)
    console.print(f"plots and sweep.json: {out}")
    return 0


def _cmd_recommend(args: argparse.Namespace) -> int:
    from distsync.errors import ConfigError
    from distsync.experiments.recommend import (Request, first_lines, left_out_lines, recommend, tables_note,
                                                uncertainty_line, verify, write_outputs)
    from distsync.options import training_from_args
    from distsync.runtime.run_folder import out_or_default, workload_tag

    solvers = [s.strip() for s in args.solvers.split(",") if s.strip()] if args.solvers else None
    request = Request(workload=args.workload, workers=args.workers, link=args.link, slow_fraction=args.slow_fraction,
                      slow_factor=args.slow_factor, jitter=args.jitter, device_ms=args.device_ms, solvers=solvers,
                      seed=args.seed, per_message_ms=args.per_message_ms, fit_from=args.fit_from,
                      budget=args.budget, time_budget_s=args.time_budget, search=args.search,
                      **training_from_args(args))
    if args.verify < 0:
        raise ConfigError(f"--verify must be >= 0, got {args.verify}")
    if not args.verify_seconds > 0:
        raise ConfigError(f"--verify-seconds must be > 0, got {args.verify_seconds:g}")
    if not args.verify_budget > 0:
        raise ConfigError(f"--verify-budget must be > 0, got {args.verify_budget:g}")
    out = out_or_default(args.out, "recommend", workload_tag(args.workload))
    _stdout().print(f"recommend: an answer within {args.time_budget:g} s (--time-budget)" + (
        f"; then the top {args.verify} (and allreduce) run for real within {args.verify_budget:g} s (--verify-budget)"
        if args.verify else ""), highlight=False, soft_wrap=True)
    with _progress() as bar:
        task = bar.add_task("searching", total=None, status="measuring", where="")

        log = _log_lines("recommend")

        def on_step(label: str, done: int, total: int) -> None:
            bar.update(task, total=total, completed=done, status=label, where=f"{done}/{total}")
            log(label, done, total)

        result = recommend(request, on_step)
        if args.verify:
            result["verify"] = verify(request, result, args.verify, out, cap_s=args.verify_seconds,
                                      budget_s=args.verify_budget, on_step=on_step)
    report = write_outputs(out, result)
    for line in first_lines(result):  # (what the time budget left undone; a ranking by throughput alone)
        _stdout().print(line, highlight=False, soft_wrap=True)
    where = result["compute_from"]
    table = Table(title=f"{args.workload} on {args.workers} workers, {args.link}: compute "
                        f"{result['compute_s'] * 1000:.2f} ms a step ({where}), model "
                        f"{result['model_bytes'] / 1e6:.3g} MB{tables_note(result)}; simulated")
    for h in ("rank", "solver", "time to target (s)", "samples/s", "waiting", "judged", "why"):
        table.add_column(h, justify="left" if h in ("solver", "judged", "why") else "right", overflow="fold")
    for i, r in enumerate(result["ranked"][:12], 1):
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.3g}"
        table.add_row(str(i), r["label"], ttt, f"{r['throughput_samples_per_s']:,.0f}",
                      f"{r['phase_share'].get('wait', 0):.0%}", r["judged"], r["reason"])
    _show(table)
    for line in left_out_lines(result):  # (candidates whose solver cannot run this model)
        _stdout().print(line, highlight=False, soft_wrap=True)
    if result.get("no_time_to_target"):  # (ranked by throughput only: say why, once)
        _stdout().print(f"no time to target: {result['no_time_to_target']}", highlight=False, soft_wrap=True)
    tied = uncertainty_line(result)
    if tied:
        _stdout().print(tied, highlight=False, soft_wrap=True)
    best = result["ranked"][0]
    _stdout().print(f"run it: {best['command']}", highlight=False, soft_wrap=True)
    for v in result.get("verify", []):
        if v["not_run"]:
            _stdout().print(f"not verified {v['label']}: {v['not_run']}", highlight=False, soft_wrap=True)
            continue
        p, m = v["predicted_time_to_target_s"], v["measured_time_to_target_s"]
        flag = " (the run was CPU-bound: no emulation of that device)" if v["cpu_bound"] else ""
        flag += f" (prediction: {v['prediction']})" if v.get("prediction") else ""
        _stdout().print(f"verified {v['label']} on {v['workers']} emulated devices: predicted "
                        f"{'-' if p is None else f'{p:.2f} s'}, measured {'not reached' if m is None else f'{m:.2f} s'}"
                        f"{flag}", highlight=False, soft_wrap=True)
    console.print(f"report: {report}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from distsync.solvers import solver_class, solver_names
    from distsync.workloads import SHIPPED

    out = _stdout()
    table = Table(title="solvers")
    table.add_column("name")
    table.add_column("options")
    for name in solver_names():
        cls = solver_class(name)
        opts = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls.Options)) or "-"
        table.add_row(name, opts)
    out.print(table)
    out.print("workloads: " + ", ".join(SHIPPED) + ", or path/to/file.py:make_workload")
    return 0


def _quiet_native_logs() -> None:
    # torch's C++ side logs connection retries to stderr; the launcher turns failures into
    # one line of its own. Read once when torch is imported, so workers keep their logs.
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        import torch  # noqa: F401

        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _terminate(signum, frame) -> NoReturn:
    # SIGTERM unwinds like Ctrl-C, so emulated networks and worker processes are cleaned up;
    # the exit status says which signal it was (143).
    raise Interrupted(signum=signum)


#: the commands that start jobs of processes
JOB_COMMANDS = ("train", "compare", "linktest", "crossover")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _build_parser().parse_args(argv)
    args.argv = argv  # (train --resume tells the options typed from argparse's defaults)
    signal.signal(signal.SIGTERM, _terminate)
    _quiet_native_logs()
    handlers = {"train": _cmd_train, "compare": _cmd_compare, "linktest": _cmd_linktest, "list": _cmd_list,
                "crossover": _cmd_crossover, "simulate": _cmd_simulate,
                "sweep": _cmd_sweep, "recommend": _cmd_recommend}
    try:
        if args.command in JOB_COMMANDS:  # (a torch distsync cannot run on: refused before a folder is made)
            from distsync.torch_private import check_torch

            check_torch()
        return handlers[args.command](args)
    except DistsyncError as e:
        console.print(f"distsync: error: {_one_line(str(e))}", markup=False, highlight=False, emoji=False,
                      soft_wrap=True)
        return exit_code(e)  # (2: a refused input; 1: a run that failed)
    except KeyboardInterrupt as e:
        partial = getattr(e, "partial", None)
        if partial is not None:  # (runtime.launch wrote the steps the workers finished)
            p = partial["partial"]
            done = sorted(set(p["steps_done"].values()))
            steps = f"{done[0]}" if len(done) == 1 else f"{done[0]}-{done[-1]}"
            of = f" (of {p['of_steps']})" if p.get("of_steps") else ""
            console.print(f"distsync: {p['reason']}; the results of the {steps} steps per worker done{of} are in "
                          f"{e.run_dir} (summary.json marked partial, events.jsonl, steps.csv)",
                          markup=False, highlight=False, soft_wrap=True)
        else:
            signum = getattr(e, "signum", signal.SIGINT)
            said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
            console.print(f"distsync: {said}", markup=False, highlight=False)
        if args.command == "train" and getattr(e, "run_dir", None) is not None:
            from distsync.runtime.launch import resume_hint

            hint = resume_hint(Path(e.run_dir))
            if hint:
                console.print(f"distsync: {hint}", markup=False, highlight=False, soft_wrap=True)
        if getattr(e, "report", None) is not None:
            console.print(f"distsync: the runs that finished are compared in {e.report}", markup=False,
                          highlight=False, soft_wrap=True)
        return exit_code(e)  # (128 + the signal)
    finally:
        from distsync.runtime.run_folder import release_all

        release_all()  # (the run folders this command held: the next job finds them let go of cleanly)


def entry() -> NoReturn:
    """The ``distsync`` command: :func:`main`, then leave at once. Everything is written and
    every job's processes and networks are gone by then; tearing down the interpreter's
    modules (torch's among them) would only add a second to every command."""
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if os.environ.get("DISTSYNC_RECORD_IMPORTS"):  # (what a benchmark that runs this command measured)
        from distsync.runtime.entry import record_imports

        record_imports()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
