"""The simulator's timing mode against the measured runs of a scored `recommend` benchmark.

    sudo python benchmarks/sim_timing_dev.py --fits benchmarks/results/sim_timing_dev --make-fits

Method, raw results and figures: docs/benchmarks/simulator.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import argument_parser, exit_on_error, provenance, write_record

ROOT = Path(__file__).resolve().parents[1]
#: the fidelity target: a predicted throughput within this share of the measured median
CLOSE = 0.15


def fit_dir(scenario: dict[str, Any], out: Path, make: bool) -> Path | None:
    """A fresh fit run of the scenario's workload, link and device time (as the scored
    benchmark made it: allreduce, 4 homogeneous workers, 60 steps), made once in ``out``
    (``make``), or None where none is there."""
    from recommend import fit_folder, make_fit_run
    from recommend_scenarios import Scenario

    sc = Scenario(workload=scenario["workload"], workers=scenario["workers"], link=scenario["link"],
                  device_ms=scenario["device_ms"], workload_options=dict(scenario.get("workload_options") or {}))
    if make:
        return make_fit_run(sc, out, seed=0)
    d = fit_folder(sc, out)
    return d if (d / "summary.json").exists() else None


def setting_for(scenario: dict[str, Any], config: dict[str, Any], fit: Path | None = None):
    """The simulator's setting for one configuration of a scored scenario: its cluster, its
    device time as the compute per step, the per-message cost its fit run gave, the training
    the configuration ran with."""
    from distsync.experiments.recommend import Request, _fit, _resolve, _Setting
    from distsync.sim.calibrate import synced_tensor_bytes

    training = config.get("training") or {}
    name = scenario["workload"]
    if ":" in name and not Path(name).is_absolute():  # (a workload file: by its absolute path, as its runs name it)
        name = str(ROOT / name)
    request = Request(workload=name, workers=scenario["workers"], link=scenario["link"],
                      device_ms=scenario["device_ms"], slow_fraction=scenario["slow_fraction"],
                      slow_factor=scenario["slow_factor"], jitter=scenario["jitter"],
                      per_message_ms=scenario.get("per_message_ms") or 0.0, seed=0,
                      fit_from=None if fit is None else str(fit),
                      workload_options=dict(scenario.get("workload_options") or {}),
                      **({"batch_size": training["batch_size"]} if training.get("batch_size") else {}))
    resolved, workload = _resolve(request)
    model = workload.make_model()
    tensors = synced_tensor_bytes(model, resolved.embedding_servers or 0)
    # (with a fit run, as `recommend --fit-from`: the device time and what that run spent around it)
    compute_s = _fit(request) if fit is not None else scenario["device_ms"] / 1000
    return _Setting(request, resolved, workload, compute_s, int(sum(tensors)), tensors)


def predict(scenario: dict[str, Any], config: dict[str, Any], fit: Path | None = None) -> float:
    """The configuration's throughput (samples/s) as this commit's timing mode predicts it."""
    from distsync.experiments.proposal import propose
    from distsync.experiments.recommend import Candidate, _timing

    cand = Candidate(propose(config["solver"], config["options"]))
    _timing(setting_for(scenario, config, fit), cand)
    return cand.throughput


def rows(raw: dict[str, Any], fits: Path | None = None, make: bool = False) -> list[dict[str, Any]]:
    """Every measured configuration: its measured median throughput, what the scored run
    predicted then, and what this commit predicts from the device time alone (the per-message
    cost the scored run fitted) and, with ``fits``, from a fresh fit run (as `recommend
    --fit-from`: the device time, what that run spent around it, its per-message cost)."""
    out = []
    for sc in raw["scenarios"]:
        fit = None if fits is None else fit_dir(sc, fits, make)
        for c in sc.get("configs") or []:
            rates = [r["throughput"] for r in c["runs"].values() if r.get("throughput")]
            if not rates:
                continue
            measured = statistics.median(rates)
            out.append({"scenario": sc["scenario"], "label": sc["label"], "config": c["label"], "solver": c["solver"],
                        "measured": measured, "then": c.get("predicted_throughput"), "device": predict(sc, c),
                        "fitted": predict(sc, c, fit) if fit is not None else None})
    return out


def _error(row: dict[str, Any], key: str) -> float | None:
    return None if row.get(key) is None else row[key] / row["measured"] - 1


def summary(got: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per solver and in all: configurations within :data:`CLOSE`, and the median error."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in got:
        e = _error(r, key)
        if e is not None:
            by[r["solver"]].append(e)
            by["all"].append(e)
    return {k: {"close": sum(abs(e) <= CLOSE for e in v), "rows": len(v), "median_error": statistics.median(v),
                "median_abs_error": statistics.median(abs(e) for e in v)} for k, v in by.items()}


COLUMNS = (("then", "as scored then"), ("device", "now: device time"), ("fitted", "now: fitted on a fresh run"))


def render(raw: dict[str, Any]) -> dict[str, str]:
    got = raw["rows"]
    head = (f"Regime: {raw['regime']}. {len(got)} configurations of {len(raw['scenarios'])} scenarios; each measured "
            f"throughput the median of its seeds' runs (3), measured at {str(raw['source_commit'])[:10]}.")
    keys = [k for k, _ in COLUMNS if any(r.get(k) is not None for r in got)]
    sums = {k: summary(got, k) for k in keys}
    lines = [head, "", "| solver | " + " | ".join(f"{t}: within {CLOSE:.0%} | median error" for k, t in COLUMNS
                                                     if k in keys) + " |",
             "|---|" + "---|---|" * len(keys)]
    for solver in [k for k in sums[keys[0]] if k != "all"] + ["all"]:
        cells = []
        for k in keys:
            v = sums[k].get(solver)
            cells.append("-" if v is None else f"{v['close']} of {v['rows']} ({v['close'] / v['rows']:.0%})")
            cells.append("-" if v is None else f"{v['median_error']:+.1%}")
        lines.append(f"| {solver} | " + " | ".join(cells) + " |")
    last = keys[-1]
    worst = sorted((r for r in got if abs(_error(r, last)) > CLOSE), key=lambda r: -abs(_error(r, last)))
    misses = [f"Configurations still outside {CLOSE:.0%} ({dict(COLUMNS)[last]}):", "",
              "| # | scenario | configuration | measured samples/s | predicted | error |", "|---|---|---|---|---|---|"]
    misses += [f"| {r['scenario']} | {r['label']} | {r['config']} | {r['measured']:,.0f} | {r[last]:,.0f} | "
               f"{_error(r, last):+.0%} |" for r in worst]
    return {"sim_timing_dev": "\n".join(lines), "sim_timing_dev_misses": "\n".join(misses)}


REGIME = ("simulated (timing mode, this commit) against emulated devices behind emulated links (netns + tbf, "
          "this 2-core machine): the first test set of benchmarks/recommend.py, spent, serving as development "
          "data: **in sample** for every term chosen while reading it")


def main(argv: list[str] | None = None) -> int:
    p = argument_parser(__doc__)
    p.add_argument("--raw", default="docs/benchmarks/raw/recommend.json", help="a scored recommend raw file")
    p.add_argument("--fits", help="a folder of fresh fit runs to fit on (made with --make-fits; root)")
    p.add_argument("--make-fits", action="store_true", help="make the fit runs missing from --fits")
    p.add_argument("--json", help="where to write the raw results (none: print only)")
    args = p.parse_args(argv)
    started = provenance("benchmarks/sim_timing_dev.py")
    source = json.loads((ROOT / args.raw).read_text())
    got = rows(source, Path(args.fits) if args.fits else None, args.make_fits)
    payload = {"source": args.raw, "source_commit": source.get("measured_commit") or source.get("commit"),
               "scenarios": [s["label"] for s in source["scenarios"]], "fits": args.fits, "rows": got}
    for block in render({**payload, "regime": REGIME}).values():
        print(block + "\n")
    if args.json:
        write_record(args.json, started, regime=REGIME, seeds=list(source.get("seeds") or []), payload=payload)
    return 0


if __name__ == "__main__":
    with exit_on_error():
        sys.exit(main())
