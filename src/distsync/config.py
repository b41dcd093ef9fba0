"""Typed run configuration, validated once at the edge.

A :class:`RunConfig` holds everything needed to re-run a job; it is written to the run
folder as ``config.json`` and read back by every worker process.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distsync.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "lars")
EMBEDDING_OPTIMIZERS = ("adagrad", "sgd")
TASKS = ("train", "linktest")
_UNITS_BIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6}

DEVICES = ("auto", "cpu", "cuda")


def parse_slow(spec: str | None) -> dict[int, float]:
    """Parse ``RANK:FACTOR[,RANK:FACTOR...]`` into ``{rank: factor}``.

    FACTOR is how many times longer that worker's compute takes (>= 1).
    """
    if spec is None or spec.strip() == "":
        return {}
    slow: dict[int, float] = {}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-9]*\.?[0-9]+)\s*x?\s*", part)
        if not m:
            raise ConfigError(
                f"bad --slow entry {part.strip()!r}: expected RANK:FACTOR, e.g. --slow 1:3 or --slow 0:2,3:1.5"
            )
        rank, factor = int(m.group(1)), float(m.group(2))
        if factor < 1.0:
            raise ConfigError(f"bad --slow entry {part.strip()!r}: FACTOR must be >= 1 (it stretches compute)")
        if rank in slow:
            raise ConfigError(f"bad --slow: rank {rank} is given twice")
        slow[rank] = factor
    return slow


@dataclass(frozen=True)
class LinkSpec:
    """A host's link: bandwidth in bits per second (each direction), one-way latency in seconds."""

    bandwidth_bps: float
    latency_s: float = 0.0

    @property
    def text(self) -> str:
        return f"{format_rate(self.bandwidth_bps)}" + (f",{self.latency_s * 1e3:g}ms" if self.latency_s else "")


def format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def parse_link(spec: str) -> LinkSpec:
    """``BANDWIDTH[,LATENCY]``: e.g. ``200mbit``, ``1gbit,2ms``, ``500kbit,300us``."""
    parts = [p.strip().lower() for p in spec.split(",")]
    if not 1 <= len(parts) <= 2:
        raise ConfigError(f"bad --link {spec!r}: expected BANDWIDTH[,LATENCY], e.g. 200mbit or 1gbit,2ms")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)", parts[0])
    if not m:
        raise ConfigError(f"bad --link bandwidth {parts[0]!r}: expected a number with kbit, mbit or gbit, e.g. 200mbit")
    bps = float(m.group(1)) * _UNITS_BIT[m.group(2)]
    if bps < 8e3:
        raise ConfigError(f"bad --link bandwidth {parts[0]!r}: at least 8kbit")
    latency = 0.0
    if len(parts) == 2:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|ms|us)", parts[1])
        if not m:
            raise ConfigError(f"bad --link latency {parts[1]!r}: expected a number with s, ms or us, e.g. 2ms")
        latency = float(m.group(1)) * _UNITS_S[m.group(2)]
    return LinkSpec(bps, latency)


def parse_key_values(items: list[str] | None, what: str = "--solver-option") -> dict[str, str]:
    """Parse repeated ``KEY=VALUE`` strings into a dict of strings."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"bad {what} {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if not key:
            raise ConfigError(f"bad {what} {item!r}: empty KEY")
        out[key] = value.strip()
    return out


@dataclass
class RunConfig:
    """One training job: workload, solver, cluster shape and budget.

    Fields left ``None`` take the workload's defaults (see ``resolve``).
    """

    workload: str = "digits"
    #: keyword arguments of the workload's factory, e.g. ``{"rows": 100000}`` for ``ctr``
    workload_options: dict[str, Any] = field(default_factory=dict)
    solver: str = "allreduce"
    solver_options: dict[str, Any] = field(default_factory=dict)
    workers: int = 2
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    #: LARS trust coefficient (``--optimizer lars``)
    lars_eta: float = 0.001
    #: linear learning-rate warm-up, in steps (LARS, and servers that apply updates)
    warmup_steps: int = 0
    seed: int = 0
    slow: dict[int, float] = field(default_factory=dict)
    #: random per-step extra compute, up to this share of a step (every worker)
    jitter: float = 0.0
    eval_every: int | None = None
    timeout_s: float = 60.0
    intra_op_threads: int = 1
    device: str = "auto"
    master_port: int | None = None
    out: str | None = None
    #: emulated link of every process, ``BANDWIDTH[,LATENCY]`` (see :func:`parse_link`)
    link: str | None = None
    #: how the link's latency was applied: "netem", "comm" (per operation in the comm
    #: layer) or "none"; set by the launcher
    link_latency_mode: str | None = None
    #: processes holding the model's embedding tables (None: the workload's default)
    embedding_servers: int | None = None
    #: how embedding servers update rows: "adagrad" or "sgd"
    embedding_optimizer: str = "adagrad"
    #: their learning rate (None: the workload's)
    embedding_lr: float | None = None
    #: set by ``distsync crossover``: ``{"address": UNIX_SOCKET_PATH, "job": index}`` of the
    #: compute-token server this job's workers ask before computing
    crossover: dict[str, Any] | None = None
    task: str = "train"
    task_options: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "RunConfig":
        """Check every field; raise :class:`ConfigError` with a one-line message."""
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"--workers must be an integer >= 1, got {self.workers!r}")
        for name in ("steps", "batch_size", "eval_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum!r}")
        if not self.lars_eta > 0:
            raise ConfigError(f"--lars-eta must be > 0, got {self.lars_eta!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout_s!r}")
        if not isinstance(self.intra_op_threads, int) or self.intra_op_threads < 1:
            raise ConfigError(f"--intra-op-threads must be an integer >= 1, got {self.intra_op_threads!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"unknown --device {self.device!r}; valid: {', '.join(DEVICES)}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be in 1..65535, got {self.master_port!r}")
        if not 0.0 <= self.jitter <= 10.0:
            raise ConfigError(f"--jitter must be in [0, 10] (a share of each step's compute), got {self.jitter!r}")
        if self.link is not None:
            parse_link(self.link)
        if self.embedding_servers is not None and (not isinstance(self.embedding_servers, int)
                                                   or self.embedding_servers < 0):
            raise ConfigError(f"--embedding-servers must be an integer >= 0, got {self.embedding_servers!r}")
        if self.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ConfigError(f"unknown --embedding-optimizer {self.embedding_optimizer!r}; "
                              f"valid: {', '.join(EMBEDDING_OPTIMIZERS)}")
        if self.embedding_lr is not None and not self.embedding_lr > 0:
            raise ConfigError(f"--embedding-lr must be > 0, got {self.embedding_lr!r}")
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}; valid: {', '.join(TASKS)}")
        for rank, factor in self.slow.items():
            if not 0 <= rank < self.workers:
                raise ConfigError(
                    f"bad --slow: rank {rank} is not a worker (workers are ranks 0..{self.workers - 1})"
                )
            if factor < 1.0:
                raise ConfigError(f"bad --slow: factor for rank {rank} must be >= 1, got {factor}")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["slow"] = {str(k): v for k, v in self.slow.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        d = dict(d)
        d["slow"] = {int(k): float(v) for k, v in (d.get("slow") or {}).items()}
        return cls(**d)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: Path) -> "RunConfig":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"config file {path} must hold a JSON object")
        return cls.from_dict(d).validate()
