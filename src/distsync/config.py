"""Typed run configuration, validated once at the edge.

A :class:`RunConfig` holds everything needed to re-run a job; it is written to the run
folder as ``config.json`` and read back by every worker process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distsync.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw", "lars")
BUFFERS = ("auto", "broadcast", "average", "local")  # (solvers/base.py: BUFFER_POLICIES)
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "cosine", "linear", "step")  # (solvers/rules.py: lr_factor)
EMBEDDING_OPTIMIZERS = ("adagrad", "sgd")
TASKS = ("train", "linktest")
#: what a job does when a worker dies (--on-failure)
ON_FAILURE = ("continue", "restart")
#: the learning rate once the job goes on with fewer workers (--shrink-lr)
SHRINK_LR = ("keep", "scale")
_UNITS_BIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6}

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
SERVER_DEVICES = ("cpu", "cuda")
#: the integers a JSON file round-trips exactly; also keeps ``seed * 1000 + rank`` (torch's
#: per-worker seed) inside the 64 bits torch.manual_seed takes
SEED_LIMIT = 2**53 - 1

# What a value of each type looks like in a config file, for messages: (one, many).
_NOUNS: dict[Any, tuple[str, str]] = {
    int: ("an integer", "integers"),
    float: ("a finite number", "finite numbers"),
    str: ("a string", "strings"),
    bool: ("true or false", "booleans"),
    type(None): ("null", "nulls"),
    Any: ("any value", "any values"),
}


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def describe_type(hint: Any, many: bool = False) -> str:
    """``hint`` in words: ``int | None`` -> "an integer or null"."""
    if hint in _NOUNS:
        return _NOUNS[hint][many]
    args = typing.get_args(hint)
    if _is_union(hint):
        parts = [describe_type(a, many) for a in args]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return ("lists" if many else "a list") + f" of {describe_type(args[0], True)}"
    if origin is dict:
        return (("objects" if many else "an object") +
                f" mapping {describe_type(args[0], True)} to {describe_type(args[1], True)}")
    return getattr(hint, "__name__", str(hint))


def matches_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as parsed from JSON or TOML) is of type ``hint``. Stricter than
    ``isinstance`` where files are sloppy: a bool is no number, a float must be finite."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an int beyond any float
            return False
    if _is_union(hint):
        return any(matches_type(value, a) for a in typing.get_args(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, tuple):
        # A file has only lists; a tuple field is filled from one.
        return isinstance(value, (list, tuple)) and all(matches_type(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(matches_type(k, args[0]) and matches_type(v, args[1])
                                               for k, v in value.items())
    return isinstance(value, hint)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: one line, however long the input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def show_names(names: Any) -> str:
    """Comma-separated names; one that is not a plain name (empty, spaces, a line break, no
    string) as its repr, so the message stays one line and shows where it starts and ends."""
    return ", ".join(n if isinstance(n, str) and re.fullmatch(r"[\w.-]+", n) else show(n) for n in names)


def check_field_types(cls: type, values: dict[str, Any], what: str = "config field") -> None:
    """Raise :class:`ConfigError` naming the first of ``values`` whose value does not have
    the type of ``cls``'s dataclass field of that name (names that are no field are skipped)."""
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in values and not matches_type(values[f.name], hints[f.name]):
            raise ConfigError(f"{what} {f.name} must be {describe_type(hints[f.name])}, "
                              f"got {show(values[f.name])}")


_WORDS_TRUE, _WORDS_FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _from_text(text: str, hint: Any) -> Any:
    """``text`` (a command-line or ``KEY=VALUE`` string) as a value of type ``hint``;
    ``ValueError`` when it is none."""
    if _is_union(hint):
        if text.strip().lower() in ("none", "null") and type(None) in typing.get_args(hint):
            return None
        for arg in typing.get_args(hint):
            if arg is not type(None):
                try:
                    return _from_text(text, arg)
                except ValueError:
                    pass
        raise ValueError(text)
    if hint is bool:
        word = text.strip().lower()
        if word in _WORDS_TRUE + _WORDS_FALSE:
            return word in _WORDS_TRUE
        raise ValueError(text)
    if hint is int:
        number = float(text)  # also takes 1e6 for an integer
        if not number.is_integer():
            raise ValueError(text)
        return int(number) if abs(number) < 2**53 else int(text)
    if hint is float:
        number = float(text)
        if not math.isfinite(number):
            raise ValueError(text)
        return number
    return text


def convert(value: Any, hint: Any, what: str) -> Any:
    """The one type converter: ``value`` (a string from the command line, or anything from a
    JSON/TOML file or Python) as a value of type ``hint``; :class:`ConfigError` naming
    ``what`` when it cannot be one. Strings are parsed; other values must already match."""
    if isinstance(value, str) and hint not in (str, Any) and not (
            _is_union(hint) and str in typing.get_args(hint)):
        try:
            value = _from_text(value, hint)
        except (ValueError, OverflowError):
            name = getattr(hint, "__name__", None) or describe_type(hint)
            raise ConfigError(f"{what}={value!r} is not a valid {name}") from None
    kinds = typing.get_args(hint) if _is_union(hint) else (hint,)
    if float in kinds and int not in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # an integer given for a float field (a file's 2 for 2.0)
    if not matches_type(value, hint):
        raise ConfigError(f"{what} must be {describe_type(hint)}, got {show(value)}")
    return value


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, choices: tuple | None = None, flag: str | None = None,
            note: str = "") -> Any:
    """A dataclass field with its allowed values declared: ``threads: int = bounded(1, ge=1)``.
    :func:`check_ranges` enforces them (``None`` always passes: it means "not set");
    ``flag`` is the name messages use (``--timeout``), ``note`` is said after the bound."""
    rule = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices).items() if v is not None}
    meta = {"range": rule, "flag": flag, "note": note}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def range_problem(value: Any, rule: dict[str, Any], integer: bool) -> str | None:
    """What ``value`` breaks in a :func:`bounded` rule, as "must be ..." (None: nothing)."""
    if value is None or not rule:
        return None
    if "choices" in rule:
        return None if value in rule["choices"] else "valid: " + ", ".join(map(str, rule["choices"]))
    lo, lo_open = (rule["gt"], True) if "gt" in rule else (rule.get("ge"), False)
    hi, hi_open = (rule["lt"], True) if "lt" in rule else (rule.get("le"), False)
    ok = ((lo is None or (value > lo if lo_open else value >= lo)) and
          (hi is None or (value < hi if hi_open else value <= hi)))
    if ok:
        return None
    kind = "an integer " if integer else ""
    if lo is not None and hi is not None:
        if integer and not lo_open and not hi_open:
            return f"must be {kind}in {lo:g}..{hi:g}"
        return f"must be {kind}in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"must be {kind}{'>' if lo_open else '>='} {lo:g}"
    return f"must be {kind}{'<' if hi_open else '<='} {hi:g}"


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Raise :class:`ConfigError` for the first field of dataclass ``obj`` outside what its
    :func:`bounded` declaration allows: "PREFIX NAME must be >= 1, got 0"."""
    hints = _field_types(type(obj))
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("range")
        if not rule:
            continue
        value = getattr(obj, f.name)
        integer = int in (typing.get_args(hints[f.name]) or (hints[f.name],))
        problem = range_problem(value, rule, integer)
        if problem is None:
            continue
        name = f.metadata.get("flag") or f.name
        if problem.startswith("valid: "):
            raise ConfigError(f"{prefix}unknown {name} {value!r}; {problem}")
        raise ConfigError(f"{prefix}{name} {problem}{f.metadata.get('note', '')}, got {value!r}")


def read_file(path: Path, what: str, parse: Callable[[str], Any], fmt: str) -> Any:
    """The parsed content of text file ``path`` (``parse``: ``json.loads``, ``tomllib.loads``);
    a :class:`ConfigError` naming ``what`` and ``path`` for any file that is not one."""
    try:
        return parse(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror}") from None
    except ValueError as e:  # also bad UTF-8, and numbers of thousands of digits
        raise ConfigError(f"{what} {path} is not valid {fmt}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply") from None


@dataclass(frozen=True)
class Budget:
    """A job's budget (``--budget``): the job stops at the first one spent. ``samples``: over
    all workers; ``seconds``: of training time; ``target``: the workload's target (or
    ``target_value``) reached by the job's metric, checked at evaluations."""

    samples: int | None = None
    seconds: float | None = None
    target: bool = False
    target_value: float | None = None
    #: the text it was parsed from (what config.json and messages show)
    spec: str = field(default="", compare=False)

    @property
    def limited(self) -> bool:
        """Whether samples or seconds end the job (else a target alone: its steps are capped)."""
        return self.samples is not None or self.seconds is not None

    @property
    def text(self) -> str:
        """As the user gave it (``spec``), else as :meth:`__str__` writes it."""
        return self.spec or str(self)

    def __str__(self) -> str:
        parts = [f"samples={self.samples}" if self.samples is not None else "",
                 f"seconds={self.seconds:g}" if self.seconds is not None else "",
                 ("target" + (f"={self.target_value:g}" if self.target_value is not None else "")) if self.target
                 else ""]
        return ",".join(p for p in parts if p)


BUDGET_FORMS = "samples=N, seconds=S, target or target=VALUE"


def parse_budget(spec: str | None) -> Budget | None:
    """``--budget``: ``samples=N``, ``seconds=S``, ``target`` or ``target=VALUE``, several
    joined by commas (the first spent ends the job). None: no budget (steps per worker)."""
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"bad --budget {spec!r}: expected {BUDGET_FORMS}")
    found: dict[str, Any] = {}
    for part in spec.split(","):
        kind, eq, value = (x.strip() for x in part.partition("="))
        if kind not in ("samples", "seconds", "target"):
            raise ConfigError(f"bad --budget {part.strip()!r}: unknown budget kind {kind!r}; expected {BUDGET_FORMS}")
        if kind in found:
            raise ConfigError(f"bad --budget {spec!r}: {kind} is given twice")
        if kind == "target" and not eq:
            found[kind] = None
            continue
        try:
            number = int(value) if kind == "samples" else float(value)
        except ValueError:
            example = {"samples": "samples=50000", "seconds": "seconds=60", "target": "target=0.9"}[kind]
            raise ConfigError(f"bad --budget {part.strip()!r}: {kind} needs "
                              f"{'a whole number' if kind == 'samples' else 'a number'}, e.g. {example}")
        if not math.isfinite(number) or (kind != "target" and number <= 0):
            raise ConfigError(f"bad --budget {part.strip()!r}: {kind} must be > 0")
        found[kind] = number
    return Budget(samples=found.get("samples"), seconds=found.get("seconds"), target="target" in found,
                  target_value=found.get("target"), spec=spec)


def parse_slow(spec: str | None) -> dict[int, float]:
    """Parse ``RANK:FACTOR[,RANK:FACTOR...]`` into ``{rank: factor}``.

    FACTOR is how many times longer that worker's compute takes (>= 1).
    """
    if spec is None or spec.strip() == "":
        return {}
    slow: dict[int, float] = {}
    for part in spec.split(","):
        # RANK has at most 9 digits: int() refuses thousands with a ValueError.
        m = re.fullmatch(r"\s*([0-9]{1,9})\s*:\s*([0-9]*\.?[0-9]+)\s*x?\s*", part)
        if not m:
            raise ConfigError(
                f"bad --slow entry {part.strip()!r}: expected RANK:FACTOR, e.g. --slow 1:3 or --slow 0:2,3:1.5"
            )
        rank, factor = int(m.group(1)), float(m.group(2))
        if factor < 1.0:
            raise ConfigError(f"bad --slow entry {part.strip()!r}: FACTOR must be >= 1 (it stretches compute)")
        if not math.isfinite(factor):  # hundreds of digits parse as inf
            raise ConfigError(f"bad --slow entry {part.strip()!r}: FACTOR must be a finite number")
        if rank in slow:
            raise ConfigError(f"bad --slow: rank {rank} is given twice")
        slow[rank] = factor
    return slow


@dataclass(frozen=True)
class Link:
    """A link: bandwidth in bits per second (each direction) and one-way latency in seconds.
    One type for real runs (``--link``, an emulated network) and the simulator (the
    alpha-beta model). ``spec``: the text it was parsed from, kept for messages."""

    bandwidth_bps: float
    latency_s: float = 0.0
    spec: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0 or not self.latency_s >= 0 or not math.isfinite(self.bandwidth_bps + self.latency_s):
            raise ConfigError(f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth_bps}, {self.latency_s}")

    @property
    def text(self) -> str:
        """``BANDWIDTH[,LATENCY]`` as the command line takes it (the numbers', not ``spec``)."""
        return f"{format_rate(self.bandwidth_bps)}" + (f",{self.latency_s * 1e3:g}ms" if self.latency_s else "")

    def __str__(self) -> str:
        return self.spec or self.text

    def transfer_s(self, nbytes: float) -> float:
        """One message of ``nbytes``: latency plus serialization."""
        return self.latency_s + 8.0 * nbytes / self.bandwidth_bps


def format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def parse_link(spec: str) -> Link:
    """``BANDWIDTH[,LATENCY]``: e.g. ``200mbit``, ``1gbit,2ms``, ``500kbit,300us``."""
    parts = [p.strip().lower() for p in spec.split(",")]
    if not 1 <= len(parts) <= 2:
        raise ConfigError(f"bad --link {spec!r}: expected BANDWIDTH[,LATENCY], e.g. 200mbit or 1gbit,2ms")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)", parts[0])
    if not m:
        raise ConfigError(f"bad --link bandwidth {parts[0]!r}: expected a number with kbit, mbit or gbit, e.g. 200mbit")
    bps = float(m.group(1)) * _UNITS_BIT[m.group(2)]
    if not math.isfinite(bps):  # hundreds of digits parse as inf
        raise ConfigError(f"bad --link bandwidth {parts[0]!r}: expected a finite number, e.g. 200mbit")
    if bps < 8e3:
        raise ConfigError(f"bad --link bandwidth {parts[0]!r}: at least 8kbit")
    latency = 0.0
    if len(parts) == 2:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|ms|us)", parts[1])
        if not m:
            raise ConfigError(f"bad --link latency {parts[1]!r}: expected a number with s, ms or us, e.g. 2ms")
        latency = float(m.group(1)) * _UNITS_S[m.group(2)]
        if not math.isfinite(latency):
            raise ConfigError(f"bad --link latency {parts[1]!r}: expected a finite number, e.g. 2ms")
    return Link(bps, latency, spec.strip())


def parse_key_values(items: list[str] | None, what: str = "--solver-option") -> dict[str, str]:
    """Parse repeated ``KEY=VALUE`` strings into a dict of strings."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"bad {what} {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        # option names take - or _; a SOLVER. prefix keeps its own spelling (ea-wild.tau)
        prefix, dot, name = key.strip().rpartition(".")
        key = prefix + dot + name.replace("-", "_")
        if not key:
            raise ConfigError(f"bad {what} {item!r}: empty KEY")
        # Keys name keyword arguments; a space or line break in one only garbles later messages.
        if not key.isprintable() or any(c.isspace() for c in key):
            raise ConfigError(f"bad {what} {item!r}: KEY must be a name without spaces, e.g. rows")
        out[key] = value.strip()
    return out


FAULT_KINDS = ("kill", "stall", "nan")
FAULT_ROLES = ("server", "coordinator", "embedding-server")
#: where in a worker's step a fault fires: at its start (``kill:RANK@STEP``), or, for
#: ``kill-after-push:RANK@STEP``, once the step is done (its push or exchange reached the
#: servers) and before the worker's journal records it
FAULT_POINTS = ("start", "after-push")


@dataclass(frozen=True)
class Fault:
    """An injected fault: ``kind`` (kill | stall | nan) hits ``target`` (a worker's rank, or the
    first process of a role) when it reaches ``step``; a stall lasts ``seconds``."""

    kind: str
    target: int | str
    step: int
    seconds: float = 0.0
    spec: str = ""
    #: where in the step it fires (one of :data:`FAULT_POINTS`)
    point: str = "start"

    def __str__(self) -> str:
        kind = self.kind if self.point == "start" else f"{self.kind}-{self.point}"
        return self.spec or f"{kind}:{self.target}@{self.step}" + (f":{self.seconds:g}" if self.kind == "stall" else "")


def parse_fault(spec: str) -> Fault:
    """``kill:RANK@STEP``, ``kill:server@STEP`` (also coordinator, embedding-server),
    ``stall:RANK@STEP:SECONDS``, ``nan:RANK@STEP`` (the loss of that step becomes NaN),
    ``kill-after-push:RANK@STEP`` (once that step's push or exchange reached the servers,
    before the worker's journal records the step)."""
    if not isinstance(spec, str):
        raise ConfigError(f"bad --fault {spec!r}: expected a string such as kill:1@40")
    # ASCII: str.isdigit takes digits such as "²" that int() refuses; at most 18 digits, as
    # int() refuses thousands.
    m = re.fullmatch(r"\s*(\w+)(?:-([\w-]+))?:([\w-]+)@([0-9]{1,18})(?::([0-9]*\.?[0-9]+))?\s*", spec, re.ASCII)
    if not m or m.group(1) not in FAULT_KINDS or (m.group(2) is not None and (
            m.group(1), m.group(2)) != ("kill", "after-push")):
        raise ConfigError(f"bad --fault {spec!r}: expected kill:RANK@STEP, kill:server@STEP, "
                          f"stall:RANK@STEP:SECONDS, nan:RANK@STEP or kill-after-push:RANK@STEP")
    kind, point, who, step, seconds = m.group(1), m.group(2) or "start", m.group(3), int(m.group(4)), m.group(5)
    target: int | str = int(who) if who.isdigit() and len(who) <= 18 else who
    if isinstance(target, str) and target not in FAULT_ROLES:
        raise ConfigError(f"bad --fault {spec!r}: {who!r} is neither a worker rank nor one of {', '.join(FAULT_ROLES)}")
    if (kind == "stall") != (seconds is not None):
        raise ConfigError(f"bad --fault {spec!r}: " + ("a stall needs :SECONDS, e.g. stall:0@20:3" if kind == "stall"
                                                      else f"{kind} takes no :SECONDS"))
    if (kind in ("stall", "nan") or point != "start") and not isinstance(target, int):
        raise ConfigError(f"bad --fault {spec!r}: {kind if point == 'start' else kind + '-' + point} applies to a "
                          f"worker rank")
    if seconds is not None and not math.isfinite(float(seconds)):
        raise ConfigError(f"bad --fault {spec!r}: SECONDS must be a finite number, e.g. stall:0@20:3")
    return Fault(kind, target, step, float(seconds or 0.0), spec.strip(), point)


@dataclass(frozen=True)
class Cadence:
    """How often checkpoints are written (``--checkpoint-every``): every ``steps`` steps or
    every ``seconds`` seconds; neither: never."""

    steps: int | None = None
    seconds: float | None = None

    def __bool__(self) -> bool:
        return self.steps is not None or self.seconds is not None

    def __str__(self) -> str:
        return str(self.steps) if self.steps is not None else f"{self.seconds:g}s" if self.seconds is not None else ""

    @property
    def value(self) -> int | str | None:
        """As config.json holds it: the steps as an integer, seconds as ``"Ns"``, never as None."""
        return self.steps if self.steps is not None else str(self) or None


def checkpoint_interval(value: Any) -> Cadence:
    """The cadence of ``--checkpoint-every``: ``50`` is every 50 steps, ``"30s"`` every 30
    seconds; ``None`` never."""
    if value is None:
        return Cadence()
    if isinstance(value, bool):
        raise ConfigError(f"bad --checkpoint-every {value!r}: expected STEPS or SECONDS with s, e.g. 50 or 30s")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1 step, got {value}")
        return Cadence(steps=value)
    m = re.fullmatch(r"\s*([0-9]{1,18})\s*", value) if isinstance(value, str) else None
    if m:
        return checkpoint_interval(int(m.group(1)))
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*s\s*", value) if isinstance(value, str) else None
    if not m or not 0 < float(m.group(1)) < math.inf:
        raise ConfigError(f"bad --checkpoint-every {value!r}: expected STEPS or SECONDS with s, e.g. 50 or 30s")
    return Cadence(seconds=float(m.group(1)))


#: what a launcher writes into a run folder's config.json beside the config
#: (:class:`distsync.runtime.resolve.Launch`)
LAUNCH_KEYS = ("resolved", "link_latency_mode", "crossover", "resume")


@dataclass
class RunOptionText:
    """The run options as a command line or config file gives them (what RunConfig takes)."""

    link: str | None = None
    budget: str | None = None
    checkpoint_every: int | str | None = None
    faults: list[str] = field(default_factory=list)


_RUN_OPTION_TEXT = {f.name: f.type for f in dataclasses.fields(RunOptionText)}
#: the RunConfig fields given as text and held as values (:func:`run_option`)
RUN_OPTION_NAMES = tuple(_RUN_OPTION_TEXT)
_RUN_OPTION_TYPES: dict[str, Any] = {"link": (Link, type(None)), "budget": (Budget, type(None)),
                                     "checkpoint_every": (Cadence, type(None)), "faults": ()}


def run_option(name: str, value: Any) -> Any:
    """``value`` of run option ``name`` as its type (text parsed; values kept as they are)."""
    if isinstance(value, _RUN_OPTION_TYPES[name]) or (
            name == "faults" and isinstance(value, (list, tuple)) and value and all(isinstance(f, Fault) for f in value)):
        return list(value) if name == "faults" else value
    check_field_types(RunOptionText, {name: value})
    return _RUN_OPTION_PARSE[name](value)


_RUN_OPTION_PARSE: dict[str, Callable[[Any], Any]] = {
    "link": lambda v: None if v is None else parse_link(v),
    "budget": parse_budget,
    "checkpoint_every": lambda v: checkpoint_interval(v) or None,
    "faults": lambda v: [parse_fault(f) for f in v],
}


@dataclass(frozen=True)
class RunConfig:
    """One training job: workload, solver, cluster shape and budget.

    Fields left ``None`` take the workload's defaults: :func:`distsync.runtime.resolve.resolve`
    fills them in, checks everything and knows the job's roles.
    """

    workload: str = "digits"
    #: keyword arguments of the workload's factory, e.g. ``{"rows": 100000}`` for ``ctr``
    workload_options: dict[str, Any] = field(default_factory=dict)
    solver: str = "allreduce"
    solver_options: dict[str, Any] = field(default_factory=dict)
    workers: int = bounded(2, ge=1, flag="--workers")
    steps: int | None = bounded(None, ge=1, flag="--steps")
    #: passes over the training data instead of --steps: resolve() sets the steps from it
    #: (:func:`distsync.runtime.resolve.epoch_steps`) and config.json keeps both
    epochs: int | None = bounded(None, ge=1, flag="--epochs")
    batch_size: int | None = bounded(None, ge=1, flag="--batch-size")
    lr: float | None = bounded(None, gt=0, flag="--lr")
    optimizer: str = bounded("sgd", choices=OPTIMIZERS, flag="--optimizer")
    momentum: float = bounded(0.0, ge=0, lt=1, flag="--momentum")
    #: how the workers' buffers are kept (auto: the solver's default; solvers/base.py)
    buffers: str = bounded("auto", choices=BUFFERS, flag="--buffers")
    weight_decay: float = bounded(0.0, ge=0, flag="--weight-decay")
    #: LARS trust coefficient (``--optimizer lars``)
    lars_eta: float = bounded(0.001, gt=0, flag="--lars-eta")
    #: linear learning-rate warm-up, in steps (every optimizer, and servers that apply updates)
    warmup_steps: int = bounded(0, ge=0, flag="--warmup-steps")
    #: the learning rate over the steps after the warm-up: constant, cosine, linear or step
    #: (:func:`~distsync.solvers.rules.lr_factor`), on the workers and on servers that step
    lr_schedule: str = bounded("constant", choices=LR_SCHEDULES, flag="--lr-schedule")
    #: clip the gradient's norm to this before each update (None: no clipping)
    clip_grad_norm: float | None = bounded(None, gt=0, flag="--clip-grad-norm")
    #: micro-batches per step, their gradients added up before one synchronization (the
    #: step's batch is this many times --batch-size)
    accumulate: int = bounded(1, ge=1, flag="--accumulate")
    #: the forward pass and the loss in fp32, or under bf16 or fp16 autocast (fp16 with a
    #: loss scaler); parameters, gradients and every message stay in the parameters' dtype
    precision: str = bounded("fp32", choices=PRECISIONS, flag="--precision")
    seed: int = 0
    slow: dict[int, float] = field(default_factory=dict)
    #: random per-step extra compute, up to this share of a step (every worker)
    jitter: float = bounded(0.0, ge=0, le=10, flag="--jitter", note=" (a share of each step's compute)")
    eval_every: int | None = bounded(None, ge=1, flag="--eval-every")
    #: emulated device: each step's compute (forward and backward) lasts this many
    #: milliseconds times the worker's --slow factor (and jitter); the real math runs inside
    #: it and the rest is slept. None: compute takes what the CPU takes
    device_ms: float | None = bounded(None, gt=0, flag="--device-ms", note=" milliseconds")
    #: the share of the emulated device time that is backward's, spent as the gradients
    #: become ready (in proportion to their parameters' sizes), so that communication started
    #: in backward overlaps it as on a real device; 0: all of it before backward
    device_backward: float = bounded(0.0, ge=0, lt=1, flag="--device-backward", note=" (a share of --device-ms)")
    #: a budget for the job as a whole instead of steps per worker: "samples=N",
    #: "seconds=S", "target" or "target=VALUE", several joined by commas (:func:`parse_budget`)
    budget: Budget | None = None
    timeout_s: float = bounded(60.0, gt=0, flag="--timeout", note=" seconds")
    intra_op_threads: int = bounded(1, ge=1, flag="--intra-op-threads")
    device: str = bounded("auto", choices=DEVICES, flag="--device")
    #: what carries collectives of CUDA tensors: nccl where each worker on a node has a GPU
    #: of its own, gloo through host memory where workers share one (auto: whichever fits)
    backend: str = bounded("auto", choices=BACKENDS, flag="--backend")
    #: where server processes keep their shard and optimizer state
    server_device: str = bounded("cpu", choices=SERVER_DEVICES, flag="--server-device")
    master_port: int | None = bounded(None, ge=1, le=65535, flag="--master-port")
    out: str | None = None
    #: each worker writes TensorBoard event files as it trains (RUN/tensorboard/worker-RANK)
    tensorboard: bool = False
    #: emulated link of every process, ``BANDWIDTH[,LATENCY]`` (see :func:`parse_link`)
    link: Link | None = None
    #: processes holding the model's embedding tables (None: the workload's default)
    embedding_servers: int | None = bounded(None, ge=0, flag="--embedding-servers")
    #: how embedding servers update rows: "adagrad" or "sgd"
    embedding_optimizer: str = bounded("adagrad", choices=EMBEDDING_OPTIMIZERS, flag="--embedding-optimizer")
    #: their learning rate (None: the workload's)
    embedding_lr: float | None = bounded(None, gt=0, flag="--embedding-lr")
    task: str = bounded("train", choices=TASKS, flag="task")
    task_options: dict[str, Any] = field(default_factory=dict)
    #: write a checkpoint every N steps (an int) or every N seconds (``"30s"``); None: never
    checkpoint_every: Cadence | None = None
    #: how many times torch's elastic agent restarts the job (from its last checkpoint)
    #: after a process fails; 0: the first failure ends the job
    max_restarts: int = bounded(0, ge=0, le=100, flag="--max-restarts")
    #: when a worker dies: "continue" (the others go on without it, no restart) or
    #: "restart" (every process restarts from the last checkpoint, up to --max-restarts)
    on_failure: str = bounded("continue", choices=ON_FAILURE, flag="--on-failure")
    #: once the job goes on with fewer workers: "keep" the learning rate, or "scale" it by
    #: live workers / workers (the global batch shrank by that much)
    shrink_lr: str = bounded("keep", choices=SHRINK_LR, flag="--shrink-lr")
    #: injected faults, e.g. ``["kill:1@40", "kill:server@30", "stall:0@20:3"]`` (:func:`parse_fault`)
    faults: list[Fault] = field(default_factory=list)
    #: start from this model state (a file as a run's ``model.pt`` holds: the state dict of
    #: the workload's model) instead of the seed's initial model; every role that builds the
    #: model loads it (``train --solver auto`` hands a candidate's model on this way)
    init_model: str | None = None

    def __post_init__(self) -> None:
        # The run options given as text (command line, config file, Python) become values
        # here, where a config is made: nothing below parses them again. Values of other
        # types are left for validate() to name. (A config changes only by
        # dataclasses.replace, which makes a new one through here.)
        for name in _RUN_OPTION_TEXT:
            object.__setattr__(self, name, run_option(name, getattr(self, name)))

    def validate(self) -> "RunConfig":
        """Check every field; raise :class:`ConfigError` with a one-line message."""
        # Types first (a config file may hold anything), so the checks below compare numbers.
        check_field_types(type(self), vars(self))
        check_ranges(self)
        if not -SEED_LIMIT <= self.seed <= SEED_LIMIT:
            raise ConfigError(f"--seed must be an integer in -{SEED_LIMIT}..{SEED_LIMIT}, got {self.seed!r}")
        for fault in self.faults:
            spec = fault.spec
            if isinstance(fault.target, int) and not 0 <= fault.target < self.workers:
                raise ConfigError(f"bad --fault {spec!r}: rank {fault.target} is not a worker "
                                  f"(workers are ranks 0..{self.workers - 1}; use server, coordinator or "
                                  f"embedding-server for the other roles)")
        if self.init_model is not None and not Path(self.init_model).is_file():
            raise ConfigError(f"init_model {self.init_model!r}: no such file (a model's state, as a run's model.pt)")
        if self.device_backward and self.device_ms is None:
            raise ConfigError("--device-backward is a share of an emulated device's time: give --device-ms too")
        for rank, factor in self.slow.items():
            if not 0 <= rank < self.workers:
                raise ConfigError(
                    f"bad --slow: rank {rank} is not a worker (workers are ranks 0..{self.workers - 1})"
                )
            if factor < 1.0:
                raise ConfigError(f"bad --slow: factor for rank {rank} must be >= 1, got {factor}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The config as config.json holds it: run options as their text."""
        typed = {n: getattr(self, n) for n in _RUN_OPTION_TEXT}
        d = dataclasses.asdict(dataclasses.replace(self, **{n: None if n != "faults" else [] for n in typed}))
        d["slow"] = {str(k): v for k, v in self.slow.items()}
        d.update(link=None if self.link is None else str(self.link),
                 budget=None if self.budget is None else self.budget.text,
                 checkpoint_every=None if self.checkpoint_every is None else self.checkpoint_every.value,
                 faults=[f.spec for f in self.faults])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """A config from a parsed file's object; types and values are checked by :meth:`validate`."""
        known = {f.name for f in dataclasses.fields(cls)}
        # (a run folder's config.json also holds what its launcher decided: read by
        # distsync.runtime.resolve.read_resolved, never part of a config)
        d = {k: v for k, v in d.items() if k not in LAUNCH_KEYS}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise ConfigError(f"unknown config field(s): {show_names(unknown)}")
        slow = {} if d.get("slow") is None else d["slow"]  # null: no slow workers, as before
        if isinstance(slow, dict):
            # JSON and TOML keys are strings: "1" is rank 1. Anything else is left for
            # validate() to name.
            d["slow"] = {int(k) if isinstance(k, str) and re.fullmatch(r"-?[0-9]{1,18}", k) else k:
                         float(v) if matches_type(v, float) else v for k, v in slow.items()}
        return cls(**d)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: Path, validate: bool = True) -> "RunConfig":
        """The config in JSON file ``path``, checked unless ``validate`` is false (a job's
        processes read what their launcher resolved and wrote)."""
        d = read_file(path, "config file", json.loads, "JSON")
        if not isinstance(d, dict):
            raise ConfigError(f"config file {path} must hold a JSON object")
        return cls.from_dict(d).validate() if validate else cls.from_dict(d)
