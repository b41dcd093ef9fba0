"""Recommend's answer as it is shown: ``recommend.json``, ``report.md`` and ``recommend.png``
(:func:`write_outputs`), and the lines said before its table (:func:`first_lines`: what the
time budget left undone, a ranking by throughput alone and its tie; :func:`left_out_lines`,
:func:`uncertainty_line`, :func:`tables_note`), each read from the answer's dict alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distsync.experiments.report import markdown_table


#: where no candidate was judged on its training, what measures that half on the user's cluster
TRAINING_HALF_COMMAND = "distsync train --solver auto"
#: candidates ranked by throughput alone within this share of the first pick's tie with it
TIE_SHARE = 0.01


def tables_note(result: dict[str, Any]) -> str:
    """What the model's bytes leave out: embedding tables on embedding servers ("" if none)."""
    tables = result.get("tables_on_servers_bytes") or 0
    return (f" synchronized (its embedding tables, {tables / 1e6:.3g} MB, sit on embedding servers: the time of "
            f"their lookups and pushes is not simulated)" if tables else "")


def throughput_alone(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where no candidate was judged on its training (every row timing only): why (each
    distinct reason), the first pick's throughput and the candidates that tie with it
    (within :data:`TIE_SHARE`; none where it stands alone); None where any was."""
    if not rows or any(r["judged"] != "timing only" for r in rows):
        return None
    top = rows[0]["throughput_samples_per_s"]
    tied = [r["label"] for r in rows if r["throughput_samples_per_s"] >= top * (1 - TIE_SHARE)]
    return {"why": list(dict.fromkeys(r["note"].removeprefix("timing only: ") for r in rows)),
            "throughput_samples_per_s": top, "tied": tied if len(tied) > 1 else []}


def first_lines(result: dict[str, Any]) -> list[str]:
    """What the answer says before its table: what the time budget left unfinished; that the
    ranking is by throughput alone, where no candidate was judged on its training, and which
    candidates tie at the top."""
    lines = [result["unfinished"]] if result.get("unfinished") else []
    alone = result.get("by_throughput_alone")
    if alone:
        lines.append(f"ranked by throughput alone: no candidate was judged on its training ({'; '.join(alone['why'])});"
                     f" its statistical half measured on your cluster, with the winner training on: "
                     f"{TRAINING_HALF_COMMAND} (docs/auto.md)")
        if alone["tied"]:
            lines.append(f"{len(alone['tied'])} candidates tie at {alone['throughput_samples_per_s']:,.0f} samples/s "
                         f"(within {TIE_SHARE:.0%}), their order is no ranking: {', '.join(alone['tied'])}")
    return lines


def uncertainty_line(result: dict[str, Any]) -> str:
    """"the first pick is not settled: ..." when others are within the answer's uncertainty
    ("" when the first pick stands alone, or has no time to target)."""
    level = result.get("within_uncertainty") or []
    if len(level) < 2:
        return ""
    rows = {r["label"]: r for r in result["ranked"]}
    shown = ", ".join(f"{label} ({rows[label]['time_to_target_range_s'][0]:.3g}-"
                      f"{rows[label]['time_to_target_range_s'][1]:.3g} s)" for label in level)
    return (f"the first pick is not settled: within the answer's uncertainty (a step's compute anywhere in its "
            f"measured spread, the target crossed anywhere between two evaluations) are {shown}; any of them")


def left_out_lines(result: dict[str, Any]) -> list[str]:
    """"left out LABEL, LABEL: why", one line per reason (a recommendation without them: none)."""
    by_why: dict[str, list[str]] = {}
    for left in result.get("left_out", []):
        by_why.setdefault(left["why"], []).append(left["label"])
    return [f"left out {', '.join(labels)}: {why}" for why, labels in by_why.items()]


def write_outputs(out: Path, result: dict[str, Any]) -> Path:
    """``recommend.json``, ``report.md`` and ``recommend.png`` (predicted time to target) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "recommend.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    req = result["request"]
    lines = [f"# Recommendation: {req['workload']} on {req['workers']} workers, link {req['link']}", "",
             "Regime: **simulated** (timing at the cluster's size; steps to target from train mode at "
             f"{result['train_workers']} workers).", "",
             f"Compute per step: {result['compute_s'] * 1000:.2f} ms "
             + ("(measured here, one thread; pass --device-ms for your device's)" if result["compute_measured_here"]
                else f"({result['compute_from']})")
             + f"; {result['per_message_ms']:.3g} ms per message beyond the link's latency"
             + f"; model {result['model_bytes'] / 1e6:.3g} MB{tables_note(result)}"
             + f"; slow workers: {req['slow_fraction']:.0%} "
               f"x{req['slow_factor']:g}; jitter {req['jitter']:g}.", ""]
    t = result.get("training")
    if t:
        given = ", ".join(f"{k}={v}" for k, v in t["workload_options"].items())
        lines += [f"Training, as `distsync train` would: batch {t['batch_size']}, lr {t['lr']:g}, {t['optimizer']} "
                  f"(momentum {t['momentum']:g}, weight decay {t['weight_decay']:g}), {t['precision']}"
                  + (f"; workload options {given}" if given else "")
                  + f"; target {result['target']}.", ""]
    lines += [f"{line[0].upper()}{line[1:]}.\n" for line in first_lines(result)]
    if result.get("no_time_to_target"):
        lines += [f"No time to target (ranked by throughput): {result['no_time_to_target']}.", ""]
    lines += [f"{line[0].upper()}{line[1:]}.\n" for line in left_out_lines(result)]
    tied = uncertainty_line(result)
    if tied:
        lines += [f"{tied[0].upper()}{tied[1:]}.", ""]
    lines += markdown_table(
        ["rank", "solver", "predicted time to target (s)", "samples/s", "waiting", "why", "command"],
        [[i, r["label"], "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.3g}",
          f"{r['throughput_samples_per_s']:,.0f}", f"{r['phase_share'].get('wait', 0):.0%}", r["reason"],
          f"`{r['command']}`"] for i, r in enumerate(result["ranked"], 1)])
    if result.get("verify"):
        lines += ["", "## Verified on this machine (emulated devices)", ""] + markdown_table(
            ["solver", "workers", "predicted (s)", "measured (s)", "predicted samples/s", "measured samples/s"],
            [[v["label"], v["workers"], _or(v["predicted_time_to_target_s"], "-"),
              "not run" if v.get("not_run") else _or(v["measured_time_to_target_s"], "not reached"),
              _or(v["predicted_throughput"], "-", "{:,.0f}"), _or(v["measured_throughput"], "-", "{:,.0f}")]
             for v in result["verify"]])
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    _plot(result, out / "recommend.png")
    return report


def _or(value: float | None, missing: str, form: str = "{:.2f}") -> str:
    return missing if value is None else form.format(value)


def _plot(result: dict[str, Any], path: Path) -> None:
    from distsync.experiments.report import _pyplot

    rows = [r for r in result["ranked"] if r["time_to_target_s"] is not None][:15]
    if not rows:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([r["label"] for r in rows][::-1], [r["time_to_target_s"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("predicted time to target (s)")
    req = result["request"]
    ax.set_title(f"{req['workload']}, {req['workers']} workers, {req['link']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
