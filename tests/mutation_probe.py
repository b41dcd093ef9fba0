"""Mutation probe: does the fast suite catch a broken update rule?

Each mutation below breaks one rule of one solver (or of the simulator's train mode) by
replacing one exact piece of source text. For each, the probe copies ``src/`` to a temporary
directory, applies that one change there (the working tree is never touched), and runs the
FAST SUITE against the copy (``PYTHONPATH=<copy>/src``, ``-x -q -n 2 -p no:cacheprovider``). The
mutation is *caught* when the suite fails, and the first failing test is recorded. A failure
counts only once confirmed: that test, run alone, fails again on the mutant and passes on the
unmutated copy; a test that does not (a timing test on a loaded machine) is set aside as
flaky and the suite runs again without it. A run that passes the per-mutation timeout counts
as caught only because it did not pass, and says ``timeout`` (see the JSON's ``outcome``).
``--confirm`` re-checks the caught rows of an existing result file that carry no
confirmation yet; ``--only NAMES --merge`` re-probes some mutations into it.

The fast suite first runs unmutated: if it fails there, the probe stops (a mutation caught by
a suite that fails anyway proves nothing).

Usage (from the repository root; the file is not collected by pytest, its name does not
start with ``test_``)::

    nice -n 19 .venv/bin/python tests/mutation_probe.py            # every mutation
    .venv/bin/python tests/mutation_probe.py --list                # names, files, rules
    nice -n 19 .venv/bin/python tests/mutation_probe.py --only ripples-group-mean-divides-by-k
    nice -n 19 .venv/bin/python tests/mutation_probe.py --check    # every snippet applies exactly once

The JSON result (default ``docs/benchmarks/raw/mutation_probe.json``) holds each mutation's
outcome, the failing test's id, the suite, its unmutated run time and the provenance of the
run (benchmarks/common.py); :func:`render` turns it into the markdown table of the docs page.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import provenance, write_record, write_results  # noqa: E402  (benchmarks/common.py)

DEFAULT_OUT = REPO / "docs" / "benchmarks" / "raw" / "mutation_probe.json"
REGIME = "a census of declared mutations, each probed once against the fast suite (a failure confirmed by its test alone)"
TIMEOUT_S = 300

#: The fast suite: the reference tests of the rules, hand-computed numbers first (a mutation
#: they catch is caught in seconds), then the multi-process references and train mode.
FAST_SUITE = [
    "tests/test_rules.py",
    "tests/test_sim_rules.py",
    "tests/test_rule_references.py",
    "tests/test_decentralized.py",
    "tests/test_async_solvers.py",
    "tests/test_background.py",
    "tests/test_diloco.py",
    "tests/test_compression.py",
    "tests/test_allreduce.py",
    "tests/test_sim_ordered.py",
    "tests/test_sim.py::test_train_mode_reproduces_the_real_solver",
    "tests/test_sim_units.py",
    "tests/test_interleavings.py",
    "tests/test_options_wired.py",
    "tests/test_state_dicts.py",
]
#: (the slow end-to-end tests stay out: the suite must say in minutes what the rules are)
SUITE_MARKER = "not slow"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # under src/distsync
    old: str  # exact source text, found exactly once
    new: str
    breaks: str  # the rule it breaks


M = Mutation
MUTATIONS: list[Mutation] = [
    # ---- the pure rules (solvers/rules.py: the runtime and the simulator both call them) ----
    M("rule-elastic-exchange-center-stays", "solvers/rules.py",
      "    x.sub_(d)\n    center.add_(d)\n    return d",
      "    x.sub_(d)\n    return d",
      "elastic exchange: the center moves by +d (x~ <- x~ + alpha (x - x~))"),
    M("rule-elastic-pull-skipped", "solvers/rules.py",
      "    d = (x - center_seen).mul_(alpha)\n    x.sub_(d)\n",
      "    d = (x - center_seen).mul_(alpha)\n",
      "elastic pull: the worker moves by -d toward the center it was sent"),
    M("rule-sync-easgd-center-without-p", "solvers/rules.py",
      "center.add_((sum_x - center * workers).mul_(alpha))",
      "center.add_((sum_x - center).mul_(alpha))",
      "sync EASGD: x~ <- x~ + alpha (sum_i x_i - p x~)"),
    M("rule-server-sgd-wrong-sign", "solvers/rules.py",
      "    center.add_(grad, alpha=-lr)",
      "    center.add_(grad, alpha=lr)",
      "server SGD: x~ <- x~ - lr g"),
    M("rule-server-momentum-ignored", "solvers/rules.py",
      "    buf.mul_(mu).add_(grad)\n    center.add_(buf, alpha=-lr)",
      "    buf.mul_(mu).add_(grad)\n    center.add_(grad, alpha=-lr)",
      "server momentum: x~ <- x~ - lr * buf, buf <- mu buf + g"),
    M("rule-pairwise-average-one-sided", "solvers/rules.py",
      "    x.add_(y).mul_(0.5)\n    y.copy_(x)\n",
      "    x.add_(y).mul_(0.5)\n",
      "AD-PSGD averaging: both partners take (x_i + x_j) / 2"),
    M("rule-bmuf-no-nesterov", "solvers/rules.py",
      "    if nesterov:\n        w_start.add_(delta, alpha=block_momentum)",
      "    if False:\n        w_start.add_(delta, alpha=block_momentum)",
      "BMUF: the next block starts from the Nesterov look-ahead w_g + m Delta"),
    M("rule-bmuf-no-block-momentum", "solvers/rules.py",
      "    delta.mul_(block_momentum).add_(g, alpha=block_lr)",
      "    delta.mul_(0.0).add_(g, alpha=block_lr)",
      "BMUF: Delta <- m Delta + zeta G"),
    M("rule-diloco-no-nesterov", "solvers/rules.py",
      "    w_start.sub_(g.add_(buf, alpha=outer_momentum) if nesterov else buf, alpha=outer_lr)",
      "    w_start.sub_(buf, alpha=outer_lr)",
      "DiLoCo: the outer step with Nesterov momentum, w_start -= lr (g + m buf)"),
    M("rule-diloco-no-outer-momentum", "solvers/rules.py",
      "    buf.mul_(outer_momentum).add_(g)",
      "    buf.mul_(0.0).add_(g)",
      "DiLoCo: the outer momentum buf <- m buf + g"),
    M("rule-streaming-merge-keeps-the-outer-share", "solvers/rules.py",
      "    local.mul_(alpha).add_(outer, alpha=1.0 - alpha)",
      "    local.mul_(1.0 - alpha).add_(outer, alpha=alpha)",
      "Streaming DiLoCo: local <- alpha local + (1 - alpha) outer"),
    M("rule-gram-schmidt-no-projection", "solvers/rules.py",
      "            rest.sub_(col * (col * rest).sum(dim=-2, keepdim=True))",
      "            pass",
      "PowerSGD: each column less its projections on the ones before it"),
    M("rule-wire-share-not-divided", "solvers/rules.py",
      "    return flat.div(workers).to(dtype)",
      "    return flat.to(dtype)",
      "fp16/bf16 on the wire: each worker sends its share of the mean, flat / p"),
    M("rule-wire-average-not-anchored", "solvers/rules.py",
      "    return wire_mean_share(flat - anchor, workers, dtype)",
      "    return wire_mean_share(flat, workers, dtype)",
      "fp16/bf16 averaging: each worker sends its share of the distance from the last synchronized model"),
    M("ma-wire-anchor-not-moved", "solvers/model_averaging.py",
      "            if self.anchor is not None:\n                self.anchor.copy_(new)",
      "            pass",
      "fp16/bf16 averaging: the anchor is the last synchronized model, moved at each synchronization"),
    M("powersgd-no-error-feedback", "solvers/compression.py",
      "                self.error[i] = (m - approx).reshape(replicas, *self.shapes[i])",
      "                pass",
      "PowerSGD: each worker keeps e = M - P Q^T and adds it to the next gradient"),
    M("powersgd-q-not-averaged", "solvers/compression.py",
      "        reduce(flat)\n        flat.div_(workers)\n        _unpack(flat, new_qs)",
      "        _unpack(flat, new_qs)",
      "PowerSGD: Q = M^T P averaged over the workers"),
    M("rule-correction-overwrites", "solvers/rules.py",
      "    live.add_(new - read)",
      "    live.copy_(new)",
      "background sync written back as a correction live + (new - read)"),
    M("rule-hogwild-sgd-first-parameter-only", "solvers/rules.py",
      "        for p, g in zip(params, grads):\n            p.add_(g, alpha=-lr)",
      "        for p, g in zip(params[:1], grads):\n            p.add_(g, alpha=-lr)",
      "Hogwild step: every parameter p <- p - lr g"),
    M("rule-weight-decay-dropped", "solvers/rules.py",
      "    g = grad.add(w, alpha=weight_decay) if weight_decay else grad",
      "    g = grad",
      "server update: g = grad + weight_decay * w"),
    # ---- allreduce / ddp ----
    M("allreduce-sum-not-mean", "solvers/allreduce.py",
      "            b.flat.div_(live)",
      "            b.flat.div_(1)",
      "allreduce: every worker steps with the MEAN of the gradients"),
    M("ddp-live-hook-sum-not-mean", "solvers/ddp.py",
      "fut.set_result(buf.div_(size))",
      "fut.set_result(buf)",
      "ddp (live membership): the bucket's all-reduce is divided by the group size"),
    # ---- periodic averaging: ma, bmuf, local ----
    M("ma-mean-wrong-divisor", "solvers/model_averaging.py",
      "            mean.div_(self.comm.group_size(group))",
      "            mean.div_(self.comm.group_size(group) + 1)",
      "ma: every `every` steps each model becomes the mean over the p workers"),
    M("ma-never-syncs", "solvers/model_averaging.py",
      "            if (step + 1) % self.options.every:\n                return",
      "            if True:\n                return",
      "ma: a synchronization every `every` steps"),
    M("bmuf-momentum-of-one-worker", "solvers/model_averaging.py",
      "self.options.outer_update(new, self.w_start, self.delta, mean, len(self.comm.live_workers))",
      "self.options.outer_update(new, self.w_start, self.delta, mean, 1)",
      "bmuf: block momentum 1 - 1/p over the p live workers"),
    M("outer-momentum-not-restored", "solvers/model_averaging.py",
      '            self.delta.copy_(state["delta"])',
      "            pass",
      "bmuf/diloco: the outer step's momentum is the solver's state (checkpoints, a healed worker)"),
    M("local-averages-like-ma", "solvers/model_averaging.py",
      'class Local(HogwildThreads, Solver):\n    """`local`',
      'class Local(ModelAveraging):\n    Options = AverageOptions\n    """`local`',
      "local: no synchronization at all (each worker's own sequential SGD)"),
    # ---- streaming diloco ----
    M("streaming-merges-the-mean-of-now", "solvers/diloco.py",
      "        k, o = job.fragment, self.options\n",
      "        k, o = job.fragment, self.options\n        mean = self.views[k].flat()\n",
      "streaming-diloco: the outer step on the fragment as it was sent, delay steps before"),
    M("streaming-in-flight-not-restored", "solvers/diloco.py",
      '        job = state["in_flight"]  # (finished again, with the others, when it is due)',
      "        job = None",
      "streaming-diloco: a synchronization in flight is part of the solver's state"),
    # ---- elastic averaging ----
    M("elastic-worker-pulls-against-the-moved-center", "solvers/elastic.py",
      "        seen = shard.center.clone()\n        d = elastic_exchange(req.payload, shard.center, self.alpha)",
      "        d = elastic_exchange(req.payload, shard.center, self.alpha)\n        seen = shard.center.clone()",
      "elastic exchange: both halves use the center as it was before the exchange"),
    M("ea-wild-worker-skips-its-pull", "solvers/elastic.py",
      "                elastic_pull(x, seen, self.alpha)",
      "                x if self.lock_free else elastic_pull(x, seen, self.alpha)",
      "ea-wild: the worker moves toward the center (x_i <- x_i - alpha (x_i - x~))"),
    M("async-measgd-without-nesterov", "solvers/elastic.py",
      '            group["nesterov"] = m > 0',
      '            group["nesterov"] = False',
      "async-measgd: local Nesterov momentum"),
    M("async-measgd-without-momentum", "solvers/elastic.py",
      '            group["momentum"] = m\n',
      '            group["momentum"] = 0.0\n',
      "async-measgd: local momentum delta"),
    M("sync-easgd-center-never-kept", "solvers/elastic.py",
      "        mine.assign(x)\n        center.assign(c)\n",
      "        mine.assign(x)\n",
      "sync-easgd: the center moves by alpha sum_i (x_i - x~) at every exchange"),
    M("fr-easgd-never-exchanges", "solvers/elastic.py",
      '    name = "fr-easgd"\n    Options = FrEASGDOptions\n',
      '    name = "fr-easgd"\n    Options = FrEASGDOptions\n\n    def after_update(self, step):\n        pass\n',
      "fr-easgd: the elastic exchange every tau steps on the training thread"),
    M("easgd-serves-in-reverse-rank-order", "solvers/shard_service.py",
      "            for worker in list(active):",
      "            for worker in reversed(list(active)):",
      "easgd: the master serves the workers one at a time in round-robin RANK order"),
    M("easgd-exchanges-every-step", "solvers/elastic.py",
      "        if (step + 1) % self.options.tau == 0:\n            self._exchange(step)",
      "        if True:\n            self._exchange(step)",
      "easgd family: an exchange every tau steps, local SGD in between"),
    # ---- parameter servers ----
    M("sync-ps-sums-the-gradients", "solvers/parameter_server.py",
      "grad = torch.stack([r.payload for r in reqs]).mean(dim=0)",
      "grad = torch.stack([r.payload for r in reqs]).sum(dim=0)",
      "sync-ps: the server steps with the mean of the round's gradients"),
    M("async-ps-never-pulls", "solvers/parameter_server.py",
      "        if step % self.options.n_fetch == 0:",
      "        if step % self.options.n_fetch == 1:",
      "async-ps: the worker pulls the center every n_fetch steps"),
    M("async-ps-pushes-only-the-last-gradient", "solvers/parameter_server.py",
      "                acc.add_(g)",
      "                acc.copy_(g)",
      "async-ps: a push carries the gradients summed over n_push steps"),
    M("async-msgd-without-server-momentum", "solvers/parameter_server.py",
      "    momentum: float | None = bounded(0.9, ge=0, lt=1)",
      "    momentum: float | None = bounded(0.0, ge=0, lt=1)",
      "async-msgd: momentum (0.9) on the server"),
    M("server-momentum-option-ignored", "solvers/parameter_server.py",
      "        return self.ctx.momentum if m is None else m",
      "        return self.ctx.momentum",
      "async-ps/async-msgd: the solver's momentum option is the server's momentum"),
    M("hogwild-threads-never-push", "solvers/parameter_server.py",
      "        self._accumulate(step, [torch.cat([by_param[id(t)].reshape(-1) for t in v.tensors]) "
      "for v in self.client.views])",
      "        pass",
      "hogwild: each thread's gradient is pushed to the servers"),
    M("hogwild-thread-step-skipped", "solvers/hogwild_threads.py",
      '        hogwild_sgd(params, grads, self.optimizer.param_groups[0]["lr"])',
      "        pass",
      "Hogwild threads: each thread's SGD step lands in the shared model"),
    # ---- decentralized ----
    M("ad-psgd-passive-applies-average-after-gradient", "solvers/decentralized.py",
      "            self._apply_pending()\n            self.optimizer.step()",
      "            self.optimizer.step()\n            self._apply_pending()",
      "AD-PSGD: the average replaces the model BEFORE the gradient is applied (passive)"),
    M("ad-psgd-active-keeps-its-own-model", "solvers/decentralized.py",
      "        self.view.assign(mine)\n        self.averaged += 1",
      "        self.averaged += 1",
      "AD-PSGD: the active takes the pair's average"),
    M("ripples-group-mean-divides-by-k", "solvers/decentralized.py",
      "        return group_mean(flat, len(group))",
      "        return group_mean(flat, self.k)",
      "Ripples: a group's sum is divided by the group's actual size"),
    M("ripples-overlap-mean-after-the-update", "solvers/decentralized.py",
      "        if self._thread is not None:\n            self._settle()\n        self.optimizer.step()",
      "        self.optimizer.step()\n        if self._thread is not None:\n            self._settle()",
      "Ripples overlap: the group's mean replaces the model before the step's update"),
    M("ripples-static-schedule-never-rotates", "solvers/decentralized.py",
      "            return static_group(self.comm.num_workers, self.k, r, self.me)",
      "            return static_group(self.comm.num_workers, self.k, 0, self.me)",
      "Ripples static: round r of the repeating schedule"),
    M("ripples-random-takes-buffered-groups-out-of-order", "solvers/decentralized.py",
      "                group = self.upcoming.pop(0)",
      "                group = self.upcoming.pop()",
      "Ripples random: groups in the coordinator's one global order"),
    M("ripples-smart-waits-for-finished-workers", "solvers/schedules.py",
      "        self.live.discard(w)\n",
      "        pass  # (still waited for)\n",
      "Ripples smart: a group forms at once when every worker still training is ready"),
    M("ripples-smart-ignores-max-wait", "solvers/schedules.py",
      "            if now >= end or not self._someone_due(end):",
      "            if not self._someone_due(end):",
      "Ripples smart: a worker waits at most max_wait_ms, then goes with whoever is ready"),
    M("ripples-smart-waits-for-workers-not-due", "solvers/schedules.py",
      "            if due > until:\n                break",
      "            if False:\n                break",
      "Ripples smart: a worker waits only while a partner is due by its pace"),
    M("static-round-never-rotates", "solvers/schedules.py",
      "    s = r % static_period(workers, k)\n    return [_arc(",
      "    s = 0\n    return [_arc(",
      "static schedule: round r chunks the workers rotated by r"),
    # ---- background (ShadowSync) ----
    M("shadow-ma-overwrites-instead-of-correcting", "solvers/shadow.py",
      "                    apply_correction(live, read, new)",
      "                    live.copy_(new)",
      "shadow-ma: the sync's result is written back as live + (new - read)"),
    M("shadow-ma-mean-wrong-divisor", "solvers/shadow.py",
      "                    mean = msg[:-1].div_(n)",
      "                    mean = msg[:-1].div_(n + 1)",
      "shadow-ma: w <- all-reduce-MEAN(w) over the trainers"),
    # (Skipping close()'s final sync altogether is an equivalent mutant: the shadow thread's
    # last sync, the one every worker joins once done, has just averaged the final models;
    # the final sync only covers a read taken a moment before the last step. The probe's run
    # of 2026-11-26 let it through; it is not declared.)
    M("shadow-final-sync-wrong-divisor", "solvers/shadow.py",
      "        self.state_view.assign(final.div_(n))",
      "        self.state_view.assign(final.div_(n + 1))",
      "shadow-ma/bmuf: close() leaves every worker with the MEAN of the final models"),
    M("shadow-ea-worker-skips-its-pull", "solvers/shadow.py",
      "            elastic_pull(new, seen, self.alpha)\n",
      "",
      "shadow-ea: w -= alpha (w - x~) in the shadow loop"),
    # ---- the simulator's train-mode rules (sim/train_rules.py) ----
    M("sim-ready-group-mean-divides-by-all-workers", "sim/train_rules.py",
      "group_mean(p[idx].sum(0), len(members))",
      "group_mean(p[idx].sum(0), self.workers)",
      "simulator, Ripples smart: a ready group's sum divided by the group's size"),
    M("sim-group-rounds-skip-pairs", "sim/train_rules.py",
      "            if len(group) < 2:\n                continue",
      "            if len(group) < 3:\n                continue",
      "simulator, Ripples static/random: every group of 2 or more averages"),
    M("sim-pairwise-averages-after-the-gradient", "sim/train_rules.py",
      "        for x in [*self.stack.values(), *self.averaged.values()]:\n"
      "            pairwise_average(x[a], x[p])\n        self._apply(a)",
      "        self._apply(a)\n        for x in [*self.stack.values(), *self.averaged.values()]:\n"
      "            pairwise_average(x[a], x[p])",
      "simulator, AD-PSGD: the active averages first, then applies its own gradient"),
    M("sim-mean-gradient-sums", "sim/train_rules.py",
      "            return v.mean(0, keepdim=True)",
      "            return v.sum(0, keepdim=True)",
      "simulator, allreduce/ddp/sync-ps: the mean gradient"),
    M("sim-periodic-average-takes-replica-0", "sim/train_rules.py",
      "            return v.mean(0)\n",
      "            return v[0].clone()\n",
      "simulator, ma/bmuf: the mean of all replicas"),
    M("sim-sync-elastic-wrong-p", "sim/train_rules.py",
      "sync_elastic_update(x, self.center[n], x.sum(0), len(x), self.alpha)",
      "sync_elastic_update(x, self.center[n], x.sum(0), len(x) + 1, self.alpha)",
      "simulator, sync-easgd: the center moves by alpha (sum_i x_i - p x~)"),
    M("sim-server-sgd-ignores-momentum", "sim/train_rules.py",
      "server_apply(c, g[n], self.buf[n] if self.buf else None, self.lr, self.momentum)",
      "server_apply(c, g[n], None, self.lr, 0.0)",
      "simulator, async-msgd: server momentum"),
    M("sim-server-sgd-never-pulls", "sim/train_rules.py",
      "        for n, p in self.stack.items():\n            p[w].copy_(self.center[n])",
      "        for n, p in self.stack.items():\n            pass",
      "simulator, async-ps: a pull replaces the worker's replica by the center"),
    M("sim-elastic-heavy-ball-not-nesterov", "sim/train_rules.py",
      "p[w].sub_(g[n].add(b, alpha=self.momentum), alpha=self.lr)",
      "p[w].sub_(b, alpha=self.lr)",
      "simulator, async-measgd: local Nesterov momentum"),
    M("sim-elastic-exchange-skipped", "sim/train_rules.py",
      "    def exchanged(self, w, t):\n        for n, p in self.stack.items():\n"
      "            elastic_exchange(p[w], self.center[n], self.alpha)",
      "    def exchanged(self, w, t):\n        for n, p in self.stack.items():\n            pass",
      "simulator, async-easgd/ea-wild: the exchange when it reaches the server"),
    M("sim-background-average-overwrites", "sim/train_rules.py",
      "            apply_correction(p, self.read[n], new.expand_as(p))",
      "            p.copy_(new.expand_as(p))",
      "simulator, shadow-ma/bmuf: the sync written back as a correction"),
    M("sim-background-elastic-write-skipped", "sim/train_rules.py",
      "            apply_correction(p, self.read[n], self.new[n])",
      "            pass",
      "simulator, shadow-ea: the worker's half written back as a correction"),
    M("sim-local-averages-every-step", "solvers/model_averaging.py",
      "        return sim.local()",
      "        return sim.periodic_average(1)",
      "simulator, local: no synchronization at all"),
]

_BY_NAME = {m.name: m for m in MUTATIONS}
assert len(_BY_NAME) == len(MUTATIONS), "two mutations share a name"


class NotApplicable(Exception):
    """A mutation's text is not in its file exactly once."""


def apply(mutation: Mutation, src_root: Path) -> None:
    """Apply ``mutation`` to the copy of ``src/`` at ``src_root`` (refuses unless its text is
    found exactly once)."""
    path = src_root / "distsync" / mutation.file
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise NotApplicable(f"mutation {mutation.name}: its text is found {count} times in src/distsync/"
                            f"{mutation.file} (exactly once needed): {mutation.old!r}")
    path.write_text(text.replace(mutation.old, mutation.new))


def copy_src(dest: Path) -> Path:
    shutil.copytree(REPO / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest / "src"


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)")


def run_suite(src_root: Path, timeout_s: float, suite: list[str] | None = None,
              deselect: list[str] = ()) -> dict:
    """The fast suite (or ``suite``) against ``src_root`` (less ``deselect``): passed, the
    first failing test, seconds, timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src_root), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), PYTHONDONTWRITEBYTECODE="1")
    # (on the machine's two cores, as make test runs, and a single test in this process: its
    # workers' start would cost more than it; -x stops at the first failure)
    workers = "0" if suite is not None and len(suite) == 1 else "2"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", "-n", workers, "-m", SUITE_MARKER,
           *(suite or FAST_SUITE),
           *(a for t in deselect for a in ("--deselect", t))]
    t0 = time.monotonic()
    # A session of its own: on a timeout (or ^C) the whole tree goes, the ranks its tests
    # forked included.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return {"passed": False, "timeout": True, "failing_test": None, "seconds": round(time.monotonic() - t0, 1),
                "tail": (out or "")[-2000:]}
    failing = next((m.group(2) for line in out.splitlines() if (m := _FAILED.match(line))), None)
    return {"passed": proc.returncode == 0, "timeout": False, "failing_test": failing, "returncode": proc.returncode,
            "seconds": round(time.monotonic() - t0, 1), "tail": out[-2000:]}


def check_imports_copy(src_root: Path) -> None:
    """The copy, not the working tree, is what ``import distsync`` finds under the probe's env."""
    env = dict(os.environ, PYTHONPATH=str(src_root))
    got = subprocess.run([sys.executable, "-c", "import distsync; print(distsync.__file__)"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120).stdout.strip()
    if not got.startswith(str(src_root)):
        raise SystemExit(f"error: under PYTHONPATH={src_root} distsync was imported from {got!r}, not the copy")


def probe(m: Mutation, src_root: Path, pristine: Path, timeout_s: float, suite: list[str] | None) -> dict:
    """One mutation's row. A failure counts only when it is the mutation's: the failing test
    is run again alone, on the mutant (it must fail again) and on the unmutated copy (it must
    pass). A test that does not (a timing test on a loaded machine) is set aside as flaky and
    the suite runs again without it (at most twice)."""
    flaky: list[str] = []
    flaky_output: dict[str, str] = {}  # (the end of the suite's output where each failed: for its diagnosis)
    seconds, confirmed = 0.0, False
    while True:
        r = run_suite(src_root, timeout_s, suite, flaky)
        seconds += r["seconds"]
        test = r["failing_test"]
        if r["passed"] or r["timeout"] or test is None or len(flaky) >= 2:
            break
        again = run_suite(src_root, timeout_s, [test])
        clean = run_suite(pristine, timeout_s, [test])
        seconds += again["seconds"] + clean["seconds"]
        if not again["passed"] and clean["passed"]:
            confirmed = True  # the mutation's own failure
            break
        flaky.append(test)
        flaky_output[test] = r["tail"][-1500:]
    caught = not r["passed"]
    return {**asdict(m), "caught": caught, "outcome": ("timeout" if r["timeout"] else "caught") if caught else "survived",
            "timeout": r["timeout"], "failing_test": test if caught else None, "confirmed": confirmed,
            "seconds": round(seconds, 1), **({"flaky_tests": flaky, "flaky_output": flaky_output} if flaky else {}),
            **({} if caught else {"tail": r["tail"][-600:]})}


def confirm(args, chosen: list[Mutation], pristine: Path, started: dict, baseline: dict | None,
            suite: list[str] | None) -> int:
    """``--confirm``: each caught row of the result file (among ``chosen``) checked again."""
    import json

    raw = json.loads(args.json.read_text())
    names = {m.name for m in chosen}
    tmp = pristine.parent.parent
    for i, row in enumerate(raw["mutations"]):
        if row["name"] not in names or not row["caught"] or row.get("confirmed"):
            continue
        m = _BY_NAME[row["name"]]
        work = tmp / "confirm" / m.name
        src_root = copy_src(work)
        apply(m, src_root)
        test = row.get("failing_test")
        ok = False
        if test and not row.get("timeout"):
            again = run_suite(src_root, args.timeout, [test])
            clean = run_suite(pristine, args.timeout, [test])
            ok = not again["passed"] and clean["passed"]
        if ok:
            row["confirmed"] = True
            print(f"{m.name}: confirmed ({test} fails on the mutant, passes unmutated)", flush=True)
        else:
            raw["mutations"][i] = row = probe(m, src_root, pristine, args.timeout, suite)
            print(f"{m.name}: not confirmed ({test}); probed again: {row['outcome']} by {row['failing_test']}"
                  f"{' (flaky set aside: ' + ', '.join(row['flaky_tests']) + ')' if row.get('flaky_tests') else ''}",
                  flush=True)
        shutil.rmtree(work, ignore_errors=True)
    raw["caught"], raw["tried"] = sum(r["caught"] for r in raw["mutations"]), len(raw["mutations"])
    raw.setdefault("confirm_runs", []).append({"provenance": started,
                                               "baseline_seconds": baseline["seconds"] if baseline else None})
    raw.pop("when", None)
    write_results(args.json, raw)
    unconfirmed = [r["name"] for r in raw["mutations"] if r["caught"] and not r.get("confirmed")]
    print(f"{raw['caught']} of {raw['tried']} caught; unconfirmed: {', '.join(unconfirmed) or 'none'}")
    return 0 if raw["caught"] == raw["tried"] and not unconfirmed else 1


def render(raw: dict) -> str:
    """The docs page's table: mutation, file, rule broken, the test that caught it (or
    SURVIVED), then one line: N of M caught."""
    rows = raw.get("mutations", [])
    lines = ["| mutation | file | rule broken | caught by |", "|---|---|---|---|"]
    for r in rows:
        if r.get("caught"):
            by = f"`{r['failing_test']}`" if r.get("failing_test") else "the suite (no test id)"
            if not r.get("confirmed"):
                by += " (unconfirmed)"
            if r.get("timeout"):
                by = f"TIMEOUT after {r['seconds']} s (counted as caught)"
        elif r.get("error"):
            by = f"NOT RUN: {r['error']}"
        else:
            by = "**SURVIVED**"
        breaks = r["breaks"].replace("|", "\\|")  # (a table cell)
        lines.append(f"| `{r['name']}` | `src/distsync/{r['file']}` | {breaks} | {by} |")
    caught = sum(1 for r in rows if r.get("caught"))
    lines += ["", f"{caught} of {len(rows)} caught."]
    if raw.get("commit"):
        base = raw.get("baseline_seconds")
        lines += ["", f"`{raw['command']}` at commit {raw['commit'][:10]}, {raw['date']}; the fast suite took "
                      f"{base:.0f} s unmutated" if base else f"`{raw['command']}` at commit {raw['commit'][:10]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated mutation names (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--check", action="store_true", help="check that every mutation applies exactly once, and exit")
    p.add_argument("--json", type=Path, default=DEFAULT_OUT, help=f"result file (default {DEFAULT_OUT.relative_to(REPO)})")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per suite run (default %(default)s)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated suite first (debugging only)")
    p.add_argument("--confirm", action="store_true",
                   help="re-check the existing --json file's caught rows (or --only's): each failing test run alone "
                        "on the mutant (must fail) and unmutated (must pass); a row that is not confirmed is probed "
                        "again in full (flaky tests set aside)")
    p.add_argument("--merge", action="store_true",
                   help="with --only: replace those mutations' rows in the existing --json file (its other rows "
                        "and provenance kept; this run's provenance added under merged_runs)")
    p.add_argument("--suite", help="comma-separated test files or ids to run instead of the fast suite (debugging "
                                   "only: the result is not written)")
    args = p.parse_args(argv)

    chosen = MUTATIONS
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in _BY_NAME]
        if unknown:
            raise SystemExit(f"error: unknown mutation(s) {', '.join(unknown)} (see --list)")
        chosen = [_BY_NAME[n] for n in names]
    if args.confirm and not args.json.exists():
        raise SystemExit(f"error: --confirm needs an existing result file ({args.json} is not there)")
    if args.merge and not (args.only and args.json.exists()):
        raise SystemExit(f"error: --merge needs --only and an existing result file ({args.json} is not there)")
    if args.list:
        for m in chosen:
            print(f"{m.name:52s} {m.file:28s} {m.breaks}")
        print(f"\n{len(chosen)} mutations; fast suite: {' '.join(FAST_SUITE)} -m '{SUITE_MARKER}'")
        return 0

    suite = [t.strip() for t in args.suite.split(",") if t.strip()] if args.suite else None
    started = provenance("tests/mutation_probe.py", argv)
    with tempfile.TemporaryDirectory(prefix="distsync-mutation-") as tmp:
        pristine = copy_src(Path(tmp) / "pristine")
        bad = []
        for m in chosen:
            try:
                apply(m, Path(shutil.copytree(pristine, Path(tmp) / "check" / m.name)))
            except NotApplicable as e:
                bad.append(str(e))
        if bad:
            print("\n".join(bad), file=sys.stderr)
            raise SystemExit(f"error: {len(bad)} mutation(s) do not apply exactly once: fix their text")
        if args.check:
            print(f"all {len(chosen)} mutations apply exactly once")
            return 0
        check_imports_copy(pristine)
        baseline = None
        if not args.skip_baseline:
            print(f"unmutated fast suite ({len(FAST_SUITE)} entries) ...", flush=True)
            baseline = run_suite(pristine, args.timeout, suite)
            print(f"  {'passed' if baseline['passed'] else 'FAILED'} in {baseline['seconds']} s", flush=True)
            if not baseline["passed"]:
                print(baseline["tail"], file=sys.stderr)
                raise SystemExit("error: the fast suite fails unmutated: no mutation result would mean anything")
        if args.confirm:
            return confirm(args, chosen, pristine, started, baseline, suite)
        results = []
        for i, m in enumerate(chosen, 1):
            work = Path(tmp) / "m" / m.name
            src_root = copy_src(work)
            apply(m, src_root)
            row = probe(m, src_root, pristine, args.timeout, suite)
            shutil.rmtree(work, ignore_errors=True)
            what = ("TIMEOUT (counted as caught)" if row["timeout"] else f"caught by {row['failing_test']}") \
                if row["caught"] else "SURVIVED"
            flaky = f"; not counted, flaky: {', '.join(row['flaky_tests'])}" if row.get("flaky_tests") else ""
            print(f"[{i}/{len(chosen)}] {m.name}: {what} ({row['seconds']} s{flaky})", flush=True)
            results.append(row)
    caught = sum(r["caught"] for r in results)
    if suite:
        print(f"{caught} of {len(results)} caught by {' '.join(suite)} (not written: --suite is for debugging)")
        return 0 if caught == len(results) else 1
    if args.merge:
        import json

        raw = json.loads(args.json.read_text())
        rows = {r["name"]: r for r in raw["mutations"]}
        rows.update({r["name"]: r for r in results})
        retired = [n for n in rows if n not in _BY_NAME]  # (rows of mutations no longer declared)
        raw["mutations"] = [rows[m.name] for m in MUTATIONS if m.name in rows]
        if retired:
            raw.setdefault("retired_mutations", []).extend(retired)
        raw["caught"], raw["tried"] = sum(r["caught"] for r in raw["mutations"]), len(raw["mutations"])
        raw.setdefault("merged_runs", []).append({"provenance": started, "mutations": [r["name"] for r in results],
                                                  "baseline_seconds": baseline["seconds"] if baseline else None})
        raw.pop("when", None)
        write_results(args.json, raw)
        print(f"{raw['caught']} of {raw['tried']} caught (after merging {len(results)})")
        return 0 if raw["caught"] == raw["tried"] else 1
    payload = {"fast_suite": FAST_SUITE, "suite_marker": SUITE_MARKER,
               "pytest_args": ["-p", "no:cacheprovider", "-x", "-q", "-n", "2"], "timeout_s": args.timeout,
               "timeout_counts_as_caught": True,
               "baseline_seconds": baseline["seconds"] if baseline else None,
               "caught": caught, "tried": len(results), "mutations": results,
               "repeats": 1}  # (one probe per mutation: a census, its failures confirmed by a second run)
    if args.only:
        write_results(args.json, {"provenance": started, **payload})
    else:
        # (the suite ran in processes of its own: what it measured is the package and its files)
        measured = [str(f.relative_to(REPO)) for f in sorted((REPO / "src" / "distsync").rglob("*.py"))]
        measured += sorted({t.split("::")[0] for t in FAST_SUITE} | {"tests/helpers.py", "tests/turns.py"})
        write_record(args.json, started, regime=REGIME, seeds=[], payload=payload, measured=measured)
    print(f"{caught} of {len(results)} caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
