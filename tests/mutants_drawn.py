"""Mutants we did not choose: a mutation tool (cosmic-ray) draws them, the fast suite must kill them.

cosmic-ray lists every mutation its operators can make in the target code (an operator
replaced, a number changed, a condition negated, a break turned into a continue...); this
runner draws a sample of them with a fixed seed, stratified over three groups so each is
tested (the simulator's timing model is most of the list otherwise):

- ``rules``: every function of ``solvers/rules.py`` (the update rules' one definition);
- ``timing``: every function of ``sim/timing.py`` and of the modules it builds on,
  ``sim/timing_base.py`` and ``sim/timing_decentralized.py`` (the simulator's timing formulas);
- ``paths``: the solvers' update and exchange paths (:data:`PATHS`: the functions of each
  solver module that apply an update, answer or make an exchange, write a sync back).

Each drawn mutant is probed as ``tests/mutation_probe.py`` probes a declared mutation: a copy
of ``src/`` with the mutant applied, the fast suite run against it (``-x``), a failure counted
only once confirmed (the failing test alone fails on the mutant and passes unmutated; a test
that does not is set aside as flaky). Results go to ``--json`` as they come (the run takes
hours, in a worktree at a pinned commit: ``--resume`` goes on from the rows already there, and
refuses other code, which draws other mutants), then ``render`` makes the docs
table: killed / total by group, and every survivor with its line, for triage (``TRIAGE``: a
survivor's reason, when it is equivalent to the original).

    nice -n 19 .venv/bin/python tests/mutants_drawn.py --list      # the draw, nothing run
    nice -n 19 .venv/bin/python tests/mutants_drawn.py --resume    # into benchmarks/progress/mutants-drawn.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import mutation_probe as probe_kit  # noqa: E402
from common import provenance, write_results  # noqa: E402

#: the run's rows as they come (committable: the run takes hours); published, once whole, as
#: docs/benchmarks/raw/mutants_drawn.json with its figure
DEFAULT_OUT = REPO / "benchmarks" / "progress" / "mutants-drawn.json"
SEED = 20261128
#: mutants drawn from each group
QUOTAS = {"rules": 50, "timing": 50, "paths": 70}
GROUP_FILES = {"rules": {"solvers/rules.py": None},
               "timing": {"sim/timing.py": None, "sim/timing_base.py": None, "sim/timing_decentralized.py": None}}
#: the solvers' update and exchange paths: module -> the functions (innermost definitions) drawn from
PATHS = {
    "solvers/decentralized.py": {"_converse", "after_backward", "update", "_apply_pending", "_average",
                                 "after_update", "_settle", "_averaging_loop"},
    "solvers/elastic.py": {"handle", "_exchange", "after_update", "moving_rate"},
    "solvers/shadow.py": {"_shadow_loop", "_exchange_live", "after_update", "wait_for_steps", "pause_after",
                          "_all_reduce_live", "close"},
    "solvers/parameter_server.py": {"apply_gradient", "handle", "_accumulate", "_push", "before_step",
                                    "after_backward", "update", "combine"},
    "solvers/model_averaging.py": {"after_update", "_combine", "_sync", "outer_update", "momentum_for"},
    "solvers/diloco.py": {"outer_update", "after_update", "_sync_fragment", "_apply_fragment", "merge"},
    "solvers/allreduce.py": {"after_backward", "_reduce", "_finish", "update"},
    "solvers/shard_service.py": {"_process", "count_update", "record_staleness"},
}
GROUP_FILES["paths"] = PATHS
#: a survivor shown equivalent to the original (same behaviour for every input the code can
#: see): its name -> why
TRIAGE: dict[str, str] = {
    "solvers/rules.py:145:ReplaceTrueWithFalse:0": "bmuf_update's default for nesterov, which no caller read "
                                                   "(every one passes it); the default is gone since",
    "solvers/rules.py:115:ReplaceBinaryOperator_BitOr_LShift:0": "an annotation, never evaluated "
                                                                 "(from __future__ import annotations)",
    "solvers/rules.py:190:ReplaceUnaryOperator_Delete_USub:3": "m.shape[1] for m.shape[-1]: the same for a matrix; "
        "for a batch of matrices the rows, and PowerSGD's P always has at least as many rows as columns "
        "(compressible()), so the extra turns see empty slices and change nothing",
    "sim/timing.py:566:NumberReplacer:166": "the value for an empty compute table, which only a run of no steps "
        "has: such a run divided by zero either way, and is refused since (Work needs a whole number of steps >= 1, "
        "tests/test_sim_units.py::test_a_simulated_run_of_no_whole_positive_number_of_steps_is_refused); the branch "
        "is gone",
    "sim/timing.py:590:ReplaceBinaryOperator_FloorDiv_Div:0": "int(i / workers) for i // workers: the same for the "
        "non-negative integer indices of a step table (far below 2**53, where a float holds them exactly)",
    "sim/timing.py:691:NumberReplacer:232": "TimingContext.background's default share, which no caller read (both "
                                            "shadow plans pass it); the default is gone since",
    "solvers/decentralized.py:485:ReplaceBinaryOperator_BitOr_Mul:3": "an annotation, never evaluated "
                                                                      "(from __future__ import annotations)",
    "solvers/shadow.py:82:NumberReplacer:7": "max(-1.0, ...) for max(0.0, ...): the pause's third term, the fastest "
        "recent sync times (1 / share - 1), is never negative, as sync_share is in (0, 1] (its declared range)",
    "solvers/shadow.py:198:ReplaceComparisonOperator_Gt_NotEq:0": "pause != 0 for pause > 0: Pacer.pause_after "
        "returns max(0.0, ...), never negative (and never NaN: the times are finite and sync_share is in (0, 1])",
    "solvers/elastic.py:218:ReplaceComparisonOperator_Eq_LtE:0": "(step + 1) % tau <= 0 for == 0: a remainder by a "
                                                                 "positive tau (its option is >= 1) is never negative",
}
#: a survivor that a test of the fast suite added or moved there since kills (checked by
#: applying the mutant and running that test): its name -> that test
_LR = "tests/test_rules.py::test_learning_rate_factors_by_hand"
_STALE = "tests/test_sim_units.py::test_a_servers_staleness_is_the_updates_between_a_workers_read_and_its_push_by_hand"
_PARTNER_DIED = ("tests/test_decentralized.py::"
                 "test_an_adpsgd_active_whose_partner_died_skips_that_averaging_and_draws_from_the_others")
_DONE_AGAIN = "tests/test_diloco.py::test_streaming_diloco_counts_a_step_done_again_after_a_death_once"
_MA_DONE_AGAIN = "tests/test_background.py::test_model_averaging_counts_a_step_done_again_after_a_death_once"
_PAIRWISE = "tests/test_sim_units.py::test_ad_psgds_averagings_by_hand_the_active_pays_each_and_the_passive_computes_on"
KILLED_SINCE: dict[str, str] = {
    "solvers/rules.py:104:NumberReplacer:16": "tests/test_rules.py::test_the_learning_rate_schedule_has_ended_past_its_steps",
    "solvers/rules.py:106:ReplaceComparisonOperator_Eq_Is:0": _LR,
    "solvers/rules.py:107:ReplaceBinaryOperator_Mul_Pow:3": _LR,
    "solvers/rules.py:110:ReplaceComparisonOperator_Eq_Gt:4": _LR,
    "solvers/rules.py:111:NumberReplacer:32": _LR,
    "sim/timing.py:61:ReplaceBinaryOperator_Div_BitOr:1":
        "tests/test_sim_units.py::test_a_paced_step_is_the_workers_over_their_summed_steps_per_second",
    "sim/timing.py:69:ReplaceBinaryOperator_Add_FloorDiv:2": "tests/test_sim_units.py::test_a_simulated_runs_summary_by_hand",
    "sim/timing.py:83:ReplaceBinaryOperator_Mul_Add:2": "tests/test_sim_units.py::test_a_simulated_runs_summary_by_hand",
    "sim/timing.py:245:ReplaceBinaryOperator_Sub_RShift:4": _STALE,
    "sim/timing.py:261:ReplaceComparisonOperator_Eq_Is:1":
        "tests/test_sim_units.py::test_a_server_run_of_more_steps_than_small_integers_ends_at_its_last_step",
    "sim/timing.py:271:NumberReplacer:75": _STALE,
    "sim/timing.py:312:ReplaceBinaryOperator_Sub_BitXor:6": _STALE,
    "sim/timing.py:368:ReplaceBinaryOperator_Add_FloorDiv:34": _PAIRWISE,
    "sim/timing.py:372:NumberReplacer:108": _PAIRWISE,
    "sim/timing.py:465:ReplaceBinaryOperator_Add_LShift:42":
        "tests/test_sim_units.py::test_ripples_smart_groups_meet_every_few_steps_as_its_option_says",
    "sim/timing.py:644:ReplaceBinaryOperator_Mul_Div:23":
        "tests/test_sim_units.py::test_an_elastic_exchange_through_the_servers_carries_every_workers_model_share_both_ways",
    "solvers/decentralized.py:203:NumberReplacer:39":
        "tests/test_decentralized.py::test_an_adpsgd_worker_reports_the_first_of_its_answering_threads_failures",
    "solvers/decentralized.py:213:ExceptionReplacer:0": _PARTNER_DIED,
    "solvers/model_averaging.py:155:NumberReplacer:32": _MA_DONE_AGAIN,
    "solvers/model_averaging.py:155:NumberReplacer:33": _MA_DONE_AGAIN,
    "solvers/model_averaging.py:155:ReplaceBinaryOperator_Add_Mul:1": _MA_DONE_AGAIN,
    "solvers/diloco.py:183:AddNot:5": _DONE_AGAIN,
    "solvers/diloco.py:184:NumberReplacer:79": _DONE_AGAIN,
    "solvers/decentralized.py:501:NumberReplacer:143":
        "tests/test_decentralized.py::test_a_ripples_group_with_a_dead_member_leaves_the_model_as_it_was_and_is_counted",
    "solvers/decentralized.py:214:ReplaceUnaryOperator_Delete_Not:4": _PARTNER_DIED,
    "solvers/decentralized.py:472:ReplaceBinaryOperator_Add_Sub:3":
        "tests/test_decentralized.py::test_two_worker_ripples_equals_plain_pytorch_reference",
    "sim/timing.py:550:ReplaceBinaryOperator_Add_Mul:50":
        "tests/test_sim_units.py::test_ripples_overlap_hides_an_averaging_shorter_than_a_step_and_waits_for_the_last",
    "solvers/model_averaging.py:175:ReplaceComparisonOperator_Gt_Lt:1":
        "tests/test_background.py::test_model_averaging_with_threads_waits_for_the_device_after_each_sync",
    "solvers/parameter_server.py:274:ZeroIterationForLoop:3":
        "tests/test_async_solvers.py::test_sync_ps_servers_with_adam_equal_large_batch_adam",
    # (the join, shadow-ea's and shadow-ma's, is solvers/shadow.py's join_shadow_thread since)
    "solvers/shadow.py:334:ReplaceBinaryOperator_Add_Sub:2":
        "tests/test_background.py::test_close_waits_for_a_shadow_sync_blocked_past_the_comms_timeout",
    # (every final request's step is solvers/shard_service.py's FINAL since; the survivor showed
    # that a server's checkpoint cut took a final request for one made before the checkpoint)
    "solvers/shadow.py:335:ReplaceUnaryOperator_Delete_USub:2":
        "tests/test_async_solvers.py::test_a_cut_leaves_out_a_workers_final_push_made_after_its_checkpoint",
}


def drawn(seed: int = SEED, quotas: dict[str, int] = QUOTAS) -> list[dict]:
    """The sample: each group's quota drawn from the tool's list of its mutants (sorted first,
    so the same code and seed draw the same mutants)."""
    from cosmic_ray.commands.init import _all_work_items

    rng = random.Random(seed)
    out = []
    for group, files in GROUP_FILES.items():
        pool = []
        for file, functions in files.items():
            for item in _all_work_items([REPO / "src" / "distsync" / file], {}):
                m = item.mutations[0]
                if functions is not None and m.definition_name not in functions:
                    continue
                pool.append({"group": group, "file": file, "operator": m.operator_name, "occurrence": m.occurrence,
                             "line": m.start_pos[0], "function": m.definition_name})
        pool.sort(key=lambda r: (r["file"], r["line"], r["operator"], r["occurrence"]))
        take = rng.sample(pool, min(quotas[group], len(pool)))
        out += sorted(take, key=lambda r: (r["file"], r["line"], r["operator"], r["occurrence"]))
    for r in out:
        r["name"] = f"{r['file']}:{r['line']}:{r['operator'].removeprefix('core/')}:{r['occurrence']}"
    return out


def mutated_source(row: dict, src_root: Path) -> tuple[str, str]:
    """(the original line, the mutated line) after writing ``row``'s mutant into the copy."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    path = src_root / "distsync" / row["file"]
    code = path.read_text()
    new = mutate_code(code, cosmic_ray.plugins.get_operator(row["operator"])(), row["occurrence"])
    if new is None:
        raise probe_kit.NotApplicable(f"{row['name']}: the tool made no mutation there")
    path.write_text(new)
    line = row["line"] - 1
    return code.splitlines()[line].strip(), new.splitlines()[line].strip() if line < len(new.splitlines()) else ""


def render(raw: dict) -> dict[str, str]:
    """The docs page's block: killed / total by group, and the survivors with their triage."""
    rows = raw.get("mutants", [])
    lines = ["| group | drawn | killed | survived | killed by a test added since | equivalent | open |",
             "|---|---|---|---|---|---|---|"]

    def counts(mine: list[dict]) -> tuple[int, int, int, int]:
        killed = sum(r["caught"] for r in mine)
        since = sum(1 for r in mine if not r["caught"] and r["name"] in KILLED_SINCE)
        equivalent = sum(1 for r in mine if not r["caught"] and r["name"] in TRIAGE)
        return killed, since, equivalent, len(mine) - killed - since - equivalent

    for group in QUOTAS:
        mine = [r for r in rows if r["group"] == group]
        killed, since, equivalent, left = counts(mine)
        lines.append(f"| {group} | {len(mine)} | {killed} | {len(mine) - killed} | {since} | {equivalent} | {left} |")
    killed, since, equivalent, left = counts(rows)
    scored = len(rows) - equivalent
    lines += ["", f"{killed} of {len(rows)} drawn mutants killed by the suite as it was; after triage, "
                  f"{killed + since} of the {scored} not shown equivalent ({100 * (killed + since) / max(1, scored):.0f}%), "
                  f"{left} open."]
    survivors = [r for r in rows if not r["caught"]]
    if survivors:
        lines += ["", "| survivor | was | became | triage |", "|---|---|---|---|"]
        for r in survivors:
            cell = lambda s: "`" + s.replace("|", "\\|").replace("`", "'") + "`"  # noqa: E731
            why = f"killed since by `{KILLED_SINCE[r['name']]}`" if r["name"] in KILLED_SINCE else \
                TRIAGE.get(r["name"], "**open**")
            lines.append(f"| `{r['name']}` ({r['function']}) | {cell(r['was'])} | {cell(r['became'])} | {why} |")
    if raw.get("commit"):
        lines += ["", f"`{raw['command']}` at commit {raw['commit'][:10]}, {raw['date']}"]
    return {"mutants_drawn": "\n".join(lines) + "\n"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=DEFAULT_OUT)
    p.add_argument("--list", action="store_true", help="print the draw and exit")
    p.add_argument("--resume", action="store_true", help="go on from the rows already in --json")
    p.add_argument("--only", help="comma-separated mutant names (from --list): probe those only, not written")
    p.add_argument("--timeout", type=float, default=probe_kit.TIMEOUT_S)
    args = p.parse_args(argv)
    rows = drawn()
    if args.list:
        for r in rows:
            print(f"{r['group']:7s} {r['name']:70s} {r['function']}")
        print(f"\n{len(rows)} mutants (seed {SEED}, quotas {QUOTAS})")
        return 0
    if args.only:
        names = set(args.only.split(","))
        rows = [r for r in rows if r["name"] in names]
    started = provenance("tests/mutants_drawn.py", argv)
    raw = json.loads(args.json.read_text()) if args.resume and args.json.exists() else \
        {"provenance": started, "seed": SEED, "quotas": QUOTAS,
         "fast_suite": probe_kit.FAST_SUITE, "suite_marker": probe_kit.SUITE_MARKER, "mutants": []}
    measured = raw["provenance"]["commit"]
    if raw["mutants"] and (started["commit"] != measured or started["dirty"]):
        raise SystemExit(f"error: {args.json} was measured at commit {str(measured)[:10]}; go on in a worktree at that "
                         f"commit, with no change (here: {str(started['commit'])[:10]}"
                         f"{', changed' if started['dirty'] else ''}): other code draws other mutants")
    done = {r["name"] for r in raw["mutants"]}
    with tempfile.TemporaryDirectory(prefix="distsync-mutants-") as tmp:
        pristine = probe_kit.copy_src(Path(tmp) / "pristine")
        probe_kit.check_imports_copy(pristine)
        if not done and not args.only:
            base = probe_kit.run_suite(pristine, args.timeout)
            print(f"unmutated fast suite: {'passed' if base['passed'] else 'FAILED'} in {base['seconds']} s",
                  flush=True)
            if not base["passed"]:
                raise SystemExit("error: the fast suite fails unmutated: no mutant's result would mean anything")
            raw["baseline_seconds"] = base["seconds"]
        todo = [r for r in rows if r["name"] not in done]
        for i, row in enumerate(todo, 1):
            work = Path(tmp) / "m" / str(i)
            src_root = probe_kit.copy_src(work)
            try:
                was, became = mutated_source(row, src_root)
            except probe_kit.NotApplicable as e:
                print(f"skipped: {e}", flush=True)
                continue
            m = probe_kit.Mutation(row["name"], row["file"], was, became, f"{row['operator']} in {row['function']}")
            result = probe_kit.probe(m, src_root, pristine, args.timeout, None)
            shutil.rmtree(work, ignore_errors=True)
            out = {**row, "was": was, "became": became,
                   **{k: result[k] for k in ("caught", "outcome", "failing_test", "confirmed", "seconds")},
                   **({"flaky_tests": result["flaky_tests"]} if "flaky_tests" in result else {})}
            print(f"[{len(done) + i}/{len(rows)}] {row['name']}: {out['outcome']}"
                  f"{' by ' + out['failing_test'] if out['failing_test'] else ''} ({out['seconds']} s)", flush=True)
            if args.only:
                continue
            raw["mutants"].append(out)
            raw["killed"], raw["drawn"] = sum(r["caught"] for r in raw["mutants"]), len(raw["mutants"])
            write_results(args.json, raw)  # (as it goes: a stopped run goes on with --resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
