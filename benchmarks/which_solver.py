"""The README's "which solver when" table, rendered from the figures' raw results.

Every figure in it is a median over the raw file's repeats with the range beside it, names
the exact solver (and options) that produced it, and says its regime; a row whose raw file is
missing says so instead of quoting anything. Which solvers a data-driven row names (the two
fastest to target on slow links, the shadow variant closest to no sync) is decided by the
medians, not typed.
"""

from __future__ import annotations

from typing import Any, Callable

from common import per_seed

from distsync.experiments.report import markdown_table
from distsync.metrics.repeats import ratios, shown, spread, verdict
from crossover import makespans
from heterogeneity_devices import times

HEADER = ["situation", "solver",
          "what was measured ([benchmarks](docs/benchmarks/README.md); median (range) over repeats)"]
NOT_MEASURED = "no current measurement (`make figures` makes it)"


def _code(name: str) -> str:
    """A solver label as a user types it, a part without ``=`` its schedule: ``ripples:smart``
    -> ``ripples --schedule smart``, ``ripples:smart:every=2`` -> ``ripples --schedule smart
    -o every=2``, ``diloco every=50`` -> ``diloco -o every=50``."""
    solver, *parts = name.replace(" ", ":").split(":")
    words = [solver]
    for part in parts:
        words += ["-o", part] if "=" in part else ["--schedule", part]
    return f"`{' '.join(words)}`"


def _speedup(values: list[float | None], what: str = "") -> str:
    """``1.78x (1.60-1.92)`` [``WHAT``], and ``, within the spread`` when the range straddles 1."""
    if spread(values) is None:
        return "did not reach the target in any repeat"
    within = " (within the spread: no clear difference)" if verdict(values) == "within the spread" else ""
    return f"{shown(values, unit='x')}{' ' + what if what else ''}{within}"


def _fastest_first(speedups: dict[str, list[float | None]]) -> dict[str, list[float | None]]:
    """``speedups`` by their median, the greatest first (none at all: last)."""
    return dict(sorted(speedups.items(), key=lambda kv: -(spread(kv[1]) or (0.0,))[0]))


def _allreduce(raw: dict[str, Any]) -> tuple[str, str]:
    every = [a / d for r in raw["rows"] for a, d in zip(r["all"]["allreduce"], r["all"]["ddp"])]
    rows = ", ".join(f"{r['workload']} x{r['workers']}" for r in raw["rows"])
    ddp = _speedup(every, "DDP's")
    return "`allreduce` (or `ddp`)", (
        f"no staleness; throughput {ddp} ({rows}; {raw['repeats']} rounds each; "
        f"CPU-bound real run)")


def _slow_speedups(raw: dict[str, Any], names: tuple[str, ...]) -> tuple[str, dict[str, list]] | None:
    """(workers, {solver: speedups to target over all-reduce per seed}) with one 3x slow worker,
    at 4 workers where measured, fastest first; None where the raw file has none of ``names``."""
    w = "4" if "4" in raw["results"] else next(iter(raw["results"]))
    case = "one 3x slow"
    if case not in raw["results"][w]:
        return None
    have = [n for n in names if n in raw["results"][w][case]]
    if not have:
        return None
    base = times(raw, w, case, "allreduce")
    sp = {n: ratios(base, times(raw, w, case, n)) for n in have}
    return w, _fastest_first(sp)


def _slow_worker(raw: dict[str, Any], names: tuple[str, ...], why: str,
                 gpu: tuple[dict[str, Any], ...] = ()) -> tuple[str, str] | None:
    """The row from digits' figure; ``gpu``: other workloads' figures of the same benchmark
    (each worker's math on a GPU), their speedups after digits'."""
    got = _slow_speedups(raw, names)
    if got is None:
        return None
    w, sp = got

    def listed(speedups: dict[str, list]) -> str:
        return "; ".join(f"{_code(n)} {_speedup(v)}" for n, v in speedups.items())

    more = [f"; {other['workload']}: {listed(also[1])} ({also[0]} emulated devices, the math on a GPU; "
            f"{other['repeats']} seeds)" for other in gpu if (also := _slow_speedups(other, names)) is not None]
    return ", ".join(_code(n) for n in sp), (
        f"{why}; speedup to target over all-reduce: {listed(sp)} (digits, {w} emulated devices, one 3x slower; "
        f"{raw['repeats']} seeds)" + "".join(more))


def _slow_links(raw: dict[str, Any]) -> tuple[str, str] | None:
    w = next(iter(raw["results"]))
    model = next(iter(raw["results"][w]))
    by = raw["results"][w][model]
    base = per_seed(by["allreduce"], "time_to_target_s")
    sp = {n: ratios(base, per_seed(s, "time_to_target_s")) for n, s in by.items() if n != "allreduce"}
    best = list(_fastest_first(sp))[:2]
    figures = "; ".join(f"{_code(n)} {_speedup(sp[n])}" for n in best)
    return ", ".join(_code(n) for n in best), (
        f"fewer or asynchronous exchanges; speedup to target over all-reduce, the best two of {len(sp)} solvers: "
        f"{figures} ({model} on 10 ms emulated devices behind 1 Gbit: an all-reduce costs five times a step's "
        f"compute; {w} workers; {raw['repeats']} seeds)")


def _shadow(raw: dict[str, Any]) -> tuple[str, str] | None:
    from shadowsync import TWINS

    n = max(raw["results"], key=int)
    by = raw["results"][n]
    per = {name: per_seed(s, "throughput_samples_per_s") for name, s in by.items()}
    shadows = [name for name in by if name.split(" ")[0] in TWINS]
    if not shadows or "local" not in per:
        return None
    best = max(shadows, key=lambda name: spread(ratios(per[name], per["local"]))[0])
    solver, _, interval = best.partition(" >=")
    twin = TWINS[solver]
    twin_text = f"its foreground twin `{twin}`'s"
    label = f"`{solver} -o min_interval_ms={interval.removesuffix('ms')}`" if interval else f"`{solver}`"
    return f"{label}, `{twin}` + `--embedding-servers`", (
        f"tables sharded on servers, dense sync off the training thread: {label} at "
        f"{shown(ratios(per[best], per['local']), unit='x')} the throughput of no sync and "
        f"{_speedup(ratios(per[best], per[twin]), twin_text)} (ctr, {n} trainers on 20 ms "
        f"emulated devices, sync threads on 2 shared cores; {raw['repeats']} seeds; the best of "
        f"{len(shadows)} shadow variants)")


def _crossover(raw: dict[str, Any]) -> tuple[str, str] | None:
    said = []
    for case in ("emulated-4-jitter", "emulated-device"):
        if case not in raw["cases"]:
            continue
        first = next(iter(raw["cases"][case].values()))
        span = makespans(raw["cases"][case])
        naive = _speedup(ratios(span["crossover"], span["naive"]), "naive sharing's")
        devices = (f"{first.get('workers', 2)} emulated 50 ms devices"
                   + (f" whose step times jitter by up to {first['jitter']:.0%}" if first.get("jitter") else ""))
        said.append(f"makespan {shown(ratios(span['crossover'], span['sequential']), unit='x')} sequential's and "
                    f"{naive} (two jobs on {devices}, behind 800 Mbit)")
    if not said:
        return None
    return "`distsync crossover`", (
        "one job computes while another communicates; against jobs simply sharing the devices it helps where they "
        f"cannot fall into turns by themselves (many devices, uneven steps): {'; '.join(said)}; "
        f"{raw['repeats']} repeats")


def _rare_sync(raw: dict[str, Any]) -> tuple[str, str] | None:
    q = raw.get("quality") or {}
    if "allreduce" not in q or len(q) < 2:
        return None
    loss = {label: [s["loss"] for s in row["seeds"].values()] for label, row in q.items()}
    best = min((label for label in q if label != "allreduce"), key=lambda label: spread(loss[label])[0])
    row, ar = q[best], q["allreduce"]
    return _code(best), (
        f"{ar['syncs'] / row['syncs']:.0f}x fewer synchronizations than an all-reduce every step ({row['syncs']} "
        f"against {ar['syncs']} per worker), eval loss {shown(loss[best])} against all-reduce's "
        f"{shown(loss['allreduce'])} (the lowest loss of {len(q) - 1} rare-sync configurations; lm, "
        f"{raw['workers']} workers, {raw['steps']} steps, AdamW; simulated train mode, the same math as real runs; "
        f"{len(next(iter(q.values()))['seeds'])} seeds)")


Cells = Callable[[dict[str, Any], dict[str, dict[str, Any]]], "tuple[str, str] | None"]

#: the slow-worker row's other workloads: the same benchmark with each worker's math on a GPU
SLOW_ON_GPU = ("heterogeneity_devices_mnist-gpu", "heterogeneity_devices_cnn-gpu")


def _alone(cells: Callable[[dict[str, Any]], tuple[str, str] | None]) -> Cells:
    """A row's cells made from its own raw file alone."""
    return lambda raw, raws: cells(raw)


#: (situation, the raw file it needs, how its cells are made from it and every other raw file)
ROWS: list[tuple[str, str | None, Cells | None, str]] = [
    ("equal devices, fast links, you want one large batch's math", "allreduce_vs_ddp", _alone(_allreduce),
     "`allreduce` (or `ddp`)"),
    ("one or a few slow workers", "heterogeneity_devices",
     lambda raw, raws: _slow_worker(raw, ("ripples:smart", "ripples:smart:every=2", "ripples:smart:overlap=true",
                                          "ad-psgd"), "nobody waits for the slow one",
                                    tuple(raws[n] for n in SLOW_ON_GPU if n in raws)),
     "`ripples --schedule smart -o overlap=true`, `ad-psgd`"),
    ("slow links, many parameters per FLOP", "async_vs_sync_devices", _alone(_slow_links),
     "`sync-easgd`, `async-measgd`"),
    ("a parameter service, asynchrony tolerated", "heterogeneity_devices",
     _alone(lambda raw: _slow_worker(raw, ("async-ps", "ea-wild"), "pushes never wait for a round")),
     "`async-ps`, `ea-wild`"),
    ("recommendation models with big embedding tables", "shadowsync_devices", _alone(_shadow),
     "`shadow-ma`, `ma` + `--embedding-servers`"),
    ("several jobs sharing the same devices", "crossover", _alone(_crossover), "`distsync crossover`"),
    ("slow links between sites, synchronizing rarely", "diloco_quality", _alone(_rare_sync),
     "`diloco`, `ma -o every=50`"),
]


def render(raws: dict[str, dict[str, Any]]) -> str:
    rows = []
    for situation, name, cells, solvers in ROWS:
        got = cells(raws[name], raws) if name in raws else None
        rows.append([situation, *(got or (solvers, NOT_MEASURED))])
    rows.append(["your model on your cluster, the choice measured", "`distsync train --solver auto`",
                 _auto(raws.get("recommend_test3"))])
    rows.append(["not sure, or thousands of workers", "`distsync recommend`",
                 _recommend(raws.get("recommend_test2") or raws.get("recommend"))])
    return "\n".join(markdown_table(HEADER, rows))


def _auto(raw: dict[str, Any] | None) -> str:
    """Auto's cell: what it does, and its score on the third test set where its raw file is there."""
    text = ("short real runs of the simulator's fastest candidates on your workers, the better half going on, "
            "the winner training on from its own model")
    if not raw or raw.get("set") != "test3":
        return f"{text}; not scored yet (`python benchmarks/figures.py run recommend_test3`)"
    s, pick = raw["summary"], "recommend's first pick"
    c, rule = s["choosers"], s["best_rule"]
    return (f"{text}; its time to target, the short runs counted, {c['auto']['geomean']:.2f}x the best in hindsight "
            f"by geometric mean (worst {c['auto']['worst']:.2f}x) over {s['scenarios']} drawn scenarios; "
            f"{pick} {c[pick]['geomean']:.2f}x, the rule \"{rule}\" {c[rule]['geomean']:.2f}x (out of sample, "
            f"emulated devices and links, one seed each)")


def _recommend(raw: dict[str, Any] | None) -> str:
    """The last row's cell: what `recommend` does, and its out-of-sample score where a test
    set's raw file is there, the newest one's (a development set's score is in sample, so it
    is not quoted)."""
    text = "simulates the candidates on your cluster's shape, `--verify` runs the top picks"
    if not raw or raw.get("set") not in ("test", "test2"):
        return text
    s = raw["summary"]
    fixed, workers = s["best_fixed"], raw["declared"]["workers"]
    return (f"{text}; its first pick hit (within the measured best's spread or {raw['tolerance']:.0%}) in "
            f"{s['hits']} of {s['scenarios']} drawn scenarios of {min(workers)}-{max(workers)} workers "
            f"({s['hit_share']:.0%}; out of sample, emulated devices and links, {len(raw['seeds'])} seeds each), "
            f"always-{fixed} with its defaults in {s['always'][fixed]['hits']}")
