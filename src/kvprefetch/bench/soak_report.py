"""What a serving soak found: its records (answers, faults, resource and metric samples), the checks issue 40 sets
(nothing failed, nothing wrong, nothing leaked, nothing hidden) and issue 59's (the server never stopped: no stretch
of `STALL_WINDOW_S` with requests outstanding and none answered, no request slower than `SLOW_S`, both outside the
server's own restarts) judged on them, one summary line, a per-fault table (TTFT and hits during each kind of fault
beside the calm windows), each stall with the faults around it, and the timeline plot.

Pure functions of the records: the soak (`kvprefetch.bench.soak_serve`) fills them, tests build them by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

SETTLE_S = 10.0  # a fault's effects are read until this long after it ended
MIN_LIFE_S = 120.0  # growth is judged over a server life at least this long (a restarted server warms up again)
GROWTH_LIMIT_PCT = 5.0
# Issue 59: a hang read as two failed requests. Requests outstanding and none answered for this long is a stall (an
# answer takes ~0.1-2 s here; a restart's window is apart), and no request outside a restart may take longer than
# SLOW_S (the client gives up only at 120 s).
STALL_WINDOW_S = 15.0
SLOW_S = 30.0
STALL_CONTEXT_S = 30.0  # a stall's table lists the faults from this long before it to its end
RESTART_KINDS = ("server_term", "server_kill")
# Where each kind of fault must show in /metrics (vllm:kvprefetch_tier_errors_total{tier, kind}).
VISIBLE_AS: dict[str, tuple[str, ...]] = {
    "redis_kill": ("remote/unavailable",),
    "disk_full": ("disk/no_space",),
    "damage": ("disk/corrupt", "disk/missing"),
}
# Kinds every fault of which must show (a full disk: every one that `bites`). Of the damage faults at least one
# must: a damaged file shows only if something reads it before it is evicted, and only when it is read (a short
# run's conversations may first read it minutes later, during another fault: `fault_moved`).
EACH_SHOWS = ("redis_kill",)


@dataclass
class Answer:
    t: float  # when the request was sent (s into the run)
    t_end: float
    ttft_s: float | None
    ok: bool
    right: bool | None  # equal to vLLM alone's (None: vLLM alone failed too)
    error: str = ""
    ref_ttft_s: float | None = None  # vLLM alone's TTFT for the same prompt (sent right after)


@dataclass
class FaultRecord:
    kind: str
    start_s: float
    end_s: float
    what: str

    @property
    def restart(self) -> bool:
        """The server's own restart: requests inside its window are counted apart."""
        return self.kind in RESTART_KINDS

    def covers(self, t0: float, t1: float, settle_s: float = SETTLE_S) -> bool:
        return t0 <= self.end_s + settle_s and t1 >= self.start_s


@dataclass
class Sample:
    t: float
    life: int  # which start of the server (0: the first; +1 per restart)
    rss_mb: float
    fds: int
    threads: int
    shm_files: int
    disk_mb: float


@dataclass
class MetricSample:
    """The server's counters at t (cumulative within a life): "prompt" (prompt tokens), "hit/<tier>" (tokens
    loaded from a kvprefetch tier; "hit/engine": vLLM's own prefix cache), "err/<tier>/<kind>" (tier errors)."""

    t: float
    life: int
    values: dict[str, float]


@dataclass
class SoakResult:
    seconds: float
    kinds: tuple[str, ...] = ()
    disk_capacity_mb: float = float("inf")
    faults: list[FaultRecord] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    metrics: list[MetricSample] = field(default_factory=list)
    log_lines: dict[str, int] = field(default_factory=dict)  # per fault kind: log lines naming it, all lives
    shm_left: list[str] = field(default_factory=list)

    # ---- classification -------------------------------------------------------------------------------------
    def apart(self, a: Answer) -> bool:
        """Inside one of the server's own restart windows (not counted as failed)."""
        return any(f.restart and f.covers(a.t, a.t_end, settle_s=5.0) for f in self.faults)

    def counted(self) -> list[Answer]:
        return [a for a in self.answers if not self.apart(a)]

    def failed(self) -> int:
        return sum(not a.ok for a in self.counted())

    def wrong(self) -> int:
        return sum(a.right is False for a in self.answers)

    # ---- progress ---------------------------------------------------------------------------------------------
    def stalls(self, window_s: float = STALL_WINDOW_S) -> list[tuple[float, float]]:
        """(from, to) of every stretch of at least `window_s` during which some request was outstanding and none
        was answered, outside the server's own restart windows (as `apart` counts them)."""
        busy: list[list[float]] = []
        for t0, t1 in sorted((a.t, a.t_end) for a in self.answers):
            if busy and t0 <= busy[-1][1]:
                busy[-1][1] = max(busy[-1][1], t1)
            else:
                busy.append([t0, t1])
        answered = sorted(a.t_end for a in self.answers if a.ok)
        restarts = sorted((f.start_s, f.end_s + 5.0) for f in self.faults if f.restart)
        out = []
        for b0, b1 in busy:
            cuts = [b0, *(t for t in answered if b0 < t < b1), b1]
            for s0, s1 in pairwise(cuts):
                out += [(p0, p1) for p0, p1 in _minus((s0, s1), restarts) if p1 - p0 >= window_s]
        return out

    def stalled_s(self) -> float:
        return sum(t1 - t0 for t0, t1 in self.stalls())

    def took_s(self, a: Answer) -> float:
        """How long the request waited: its TTFT when answered, else until it failed."""
        return a.ttft_s if a.ok and a.ttft_s is not None else a.t_end - a.t

    def slow(self, limit_s: float = SLOW_S) -> list[Answer]:
        """Requests outside the server's restarts that waited longer than `limit_s`."""
        return [a for a in self.counted() if self.took_s(a) > limit_s]

    def max_ttft_s(self) -> float:
        return max((a.ttft_s for a in self.counted() if a.ok and a.ttft_s is not None), default=0.0)

    # ---- growth -----------------------------------------------------------------------------------------------
    def growth_window(self) -> tuple[float, float] | None:
        """Where growth is judged: the second half of the last server life (the run's second half when the server
        never restarted; a restarted server warms up again), None when that life is too short to judge."""
        last = max((s.life for s in self.samples), default=0)
        life = [s.t for s in self.samples if s.life == last]
        if not life or life[-1] - life[0] < MIN_LIFE_S:
            return None
        mid = max(life[0] + (life[-1] - life[0]) / 2, self.seconds / 2 if last == 0 else 0.0)
        return mid, life[-1]

    def growth(self, attr: str) -> float:
        """Growth of a sampled resource over `growth_window` (first vs last three samples), in %."""
        window = self.growth_window()
        last = max((s.life for s in self.samples), default=0)
        half = [getattr(s, attr) for s in self.samples if window and s.life == last and s.t >= window[0]]
        if len(half) < 6:
            return 0.0
        first, end = sorted(half[:3])[1], sorted(half[-3:])[1]
        return 100.0 * (end - first) / max(first, 1e-9)

    # ---- metrics over a window --------------------------------------------------------------------------------
    def moved(self, t0: float, t1: float) -> dict[str, float]:
        """What the counters moved between t0 and t1, summed over the server lives the window spans."""
        out: dict[str, float] = {}
        for life in sorted({m.life for m in self.metrics}):
            inside = [m for m in self.metrics if m.life == life and t0 <= m.t <= t1]
            before = [m for m in self.metrics if m.life == life and m.t < t0]
            if not inside:
                continue
            base = before[-1].values if before else {}
            for k, v in inside[-1].values.items():
                d = v - base.get(k, 0.0)
                if d:
                    out[k] = out.get(k, 0.0) + d
        return out

    def bites(self, f: FaultRecord) -> bool:
        """Whether a fault can show (other kinds always; a full disk, see `unbitten`)."""
        return self.unbitten(f) is None

    def unbitten(self, f: FaultRecord) -> str | None:
        """Why a full disk could not show, or None: the disk tier at its capacity (it makes room by evicting its
        own oldest chunks, as always, and no write fails), or no chunk written to the disk while it was full (a
        light load can go a whole fault without a new chunk). Chunks saved are not chunks written: one the engine
        computed again though the disk held it goes to DRAM and is not rewritten (in a local 90 s run's fault the
        workers saved 56 chunks and 33 writes met the full disk; a CI run's fault with chunks saved showed none)."""
        if f.kind != "disk_full":
            return None
        before = [s.disk_mb for s in self.samples if s.t <= f.start_s]
        if before and before[-1] >= 0.95 * self.disk_capacity_mb:
            return "tier at capacity"
        return "nothing written" if self.written_during(f) == 0 else None

    def written_during(self, f: FaultRecord) -> float | None:
        """Chunk writes to the disk tier that ended between the first /metrics sample inside the fault and the
        last, within one server life (the injector reads /metrics once the disk is full and just before it frees
        it); None where the samples cannot tell. Samples outside the fault would count writes to a disk with room:
        a CI run's fault of 8 s, read from samples 5 s apart, counted chunks saved before it and rightly showed no
        error."""
        inside = [m for m in self.metrics if f.start_s <= m.t <= f.end_s]
        if len(inside) < 2 or inside[0].life != inside[-1].life or "written" not in inside[-1].values:
            return None
        return inside[-1].values["written"] - inside[0].values.get("written", 0.0)

    def shown(self, f: FaultRecord) -> float:
        """The tier errors a fault of a visible kind moved in /metrics."""
        return sum(v for k, v in self.fault_moved(f).items() if k.removeprefix("err/") in VISIBLE_AS.get(f.kind, ()))

    def fault_moved(self, f: FaultRecord) -> dict[str, float]:
        """What /metrics moved while the fault was on and `SETTLE_S` after, up to the next fault. A damage fault's
        damaged files show whenever something first reads them, which can be after other faults began (no other
        kind makes a chunk corrupt or missing): its window runs to the next damage fault or the run's end."""
        later = [g.start_s for g in self.faults if g.start_s > f.start_s and (f.kind != "damage" or g.kind == f.kind)]
        nxt = min(later, default=self.seconds)
        return self.moved(f.start_s, nxt if f.kind == "damage" else min(f.end_s + SETTLE_S, nxt))

    # ---- the checks ---------------------------------------------------------------------------------------------
    def checks(self, min_per_kind: int = 2) -> list[tuple[str, bool, str]]:
        """(name, passed, detail) for every check issue 40 sets that this run can judge."""
        stalls, slow = self.stalls(), self.slow()
        out = [
            ("no failed request outside restarts", self.failed() == 0, f"{self.failed()} failed"),
            ("no wrong answer", self.wrong() == 0, f"{self.wrong()} wrong"),
            (f"no stall ({STALL_WINDOW_S:.0f} s with requests outstanding and none answered)", not stalls,
             "; ".join(f"{t1 - t0:.0f} s from {t0:.1f} s" for t0, t1 in stalls) or "none"),
            (f"every request outside restarts answered within {SLOW_S:.0f} s", not slow,
             f"{len(slow)} slower (the slowest {max(map(self.took_s, slow), default=0.0):.1f} s); max TTFT "
             f"{self.max_ttft_s():.1f} s"),
            ("no DRAM pool left after the stop", not self.shm_left, ", ".join(self.shm_left) or "none"),
        ]
        for kind in self.kinds:
            n = sum(f.kind == kind for f in self.faults)
            out.append((f"{kind} injected >= {min_per_kind}x", n >= min_per_kind, f"{n}x"))
            shown = 0.0
            if kind in VISIBLE_AS:
                faults = [f for f in self.faults if f.kind == kind]
                seen = [self.shown(f) for f in faults]
                shown = sum(seen)
                must = [x for f, x in zip(faults, seen, strict=True) if kind in EACH_SHOWS or self.bites(f)]
                ok = bool(must) and (min(must) > 0 if kind in EACH_SHOWS or kind == "disk_full" else shown > 0)
                per = ", ".join(f"{x:.0f}" + (f" ({why})" if (why := self.unbitten(f)) else "")
                                for f, x in zip(faults, seen, strict=True))  # fmt: skip
                out.append((f"{kind} in /metrics", ok, f"tier errors {'/'.join(VISIBLE_AS[kind])} per fault: {per}"))
            if kind in LOG_NAMES and n:
                lines = self.log_lines.get(kind, 0)
                ok = (lines >= 1 or not shown) and lines <= LOG_LINES_PER_FAULT * n
                out.append((f"{kind} logged once per fault (not per chunk)", ok, f"{lines} lines for {n} faults"))
        if self.seconds >= 2 * MIN_LIFE_S + 60:
            window = self.growth_window()
            span = f" ({window[0]:.0f}-{window[1]:.0f} s)" if window else " (no server life long enough)"
            for name, attr in (("rss", "rss_mb"), ("fds", "fds"), ("threads", "threads"), ("disk", "disk_mb")):
                g = self.growth(attr)
                ok = window is not None and g < GROWTH_LIMIT_PCT
                out.append((f"{name} growth < {GROWTH_LIMIT_PCT:.0f}%", ok, f"{g:.1f}%{span}"))
        return out

    def summary(self) -> str:
        growth = " ".join(f"{name}_growth={self.growth(attr):.1f}%"
                          for name, attr in (("rss", "rss_mb"), ("fd", "fds"), ("thread", "threads")))  # fmt: skip
        moved = self.moved(0.0, self.seconds + 60)
        hits = sum(v for k, v in moved.items() if k.startswith("hit/") and k != "hit/engine")
        ratio = hits / moved["prompt"] if moved.get("prompt") else 0.0
        apart = len(self.answers) - len(self.counted())
        return (f"soak-serve: seconds={self.seconds:.0f} requests={len(self.counted())} failed={self.failed()} "
                f"wrong={self.wrong()} stalled_s={self.stalled_s():.0f} max_ttft_s={self.max_ttft_s():.1f} "
                f"faults={len(self.faults)} apart={apart} {growth} "
                f"shm_left={len(self.shm_left)} hit_ratio={ratio:.2f} "
                f"released={moved.get('released', 0.0):.0f} unparked={moved.get('unparked', 0.0):.0f}")  # fmt: skip


def _minus(span: tuple[float, float], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of span outside every hole (holes sorted by start)."""
    out, t0 = [], span[0]
    for h0, h1 in holes:
        if h1 <= t0 or h0 >= span[1]:
            continue
        if h0 > t0:
            out.append((t0, h0))
        t0 = max(t0, h1)
    if t0 < span[1]:
        out.append((t0, span[1]))
    return out


# Log lines that name a fault (counted over every server log of the run), and how many one fault may take: the
# scheduler and the worker process each log an episode of each cause once (a damage fault has two causes, a
# corrupt file and a deleted one), and a restart's scan of the disk tier one more. A line per chunk would take
# more: a damage fault damages 8 files.
LOG_NAMES: dict[str, tuple[str, ...]] = {
    "redis_kill": ("remote tier redis unavailable",),
    "disk_full": ("disk write-back failed",),
    "damage": ("disk chunk load failed", "disk tier: removing"),
}
LOG_LINES_PER_FAULT = 5


def count_log_lines(texts: Iterable[str]) -> dict[str, int]:
    return {kind: sum(line_count(t, pats) for t in texts) for kind, pats in LOG_NAMES.items()}


def line_count(text: str, patterns: Sequence[str]) -> int:
    return sum(1 for line in text.splitlines() if any(p in line for p in patterns))


# ---- per-fault table ----------------------------------------------------------------------------------------------
def _pcts(ttfts: list[float]) -> tuple[float, float]:
    if not ttfts:
        return float("nan"), float("nan")
    return float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99))


def by_condition(result: SoakResult) -> list[dict]:
    """TTFT p50/p99 and the hit ratio per fault kind (answers sent while one was on, or within SETTLE_S after)
    and for the calm rest of the run."""
    rows = []
    in_fault: set[int] = set()
    for kind in dict.fromkeys(f.kind for f in result.faults):
        faults = [f for f in result.faults if f.kind == kind]
        idx = [i for i, a in enumerate(result.answers) if any(f.covers(a.t, a.t) for f in faults)]
        in_fault |= set(idx)
        moved: dict[str, float] = {}
        for f in faults:
            for k, v in result.fault_moved(f).items():
                moved[k] = moved.get(k, 0.0) + v
        span = sum(f.end_s - f.start_s for f in faults)
        rows.append(_row(kind, [result.answers[i] for i in idx], moved, span, result.apart))
    calm = [a for i, a in enumerate(result.answers) if i not in in_fault]
    moved: dict[str, float] = {}
    for t0, t1 in calm_spans(result):
        for k, v in result.moved(t0, t1).items():
            moved[k] = moved.get(k, 0.0) + v
    rows.append(_row("calm", calm, moved, 0.0, result.apart))
    return rows


def calm_spans(result: SoakResult) -> list[tuple[float, float]]:
    """The stretches of the run no fault covers (nor its SETTLE_S after)."""
    spans, t = [], 0.0
    for f in sorted(result.faults, key=lambda f: f.start_s):
        if f.start_s > t:
            spans.append((t, f.start_s))
        t = max(t, f.end_s + SETTLE_S)
    if t < result.seconds:
        spans.append((t, result.seconds + 60))  # (the last sample comes after the run's end)
    return spans


def _row(kind: str, answers: list[Answer], moved: dict[str, float], seconds: float,
         apart: Callable[[Answer], bool]) -> dict:  # fmt: skip
    ok = [a.ttft_s for a in answers if a.ok and a.ttft_s is not None]
    p50, p99 = _pcts(ok)
    hits = {k.removeprefix("hit/"): v for k, v in moved.items() if k.startswith("hit/")}
    prompt = moved.get("prompt", 0.0)
    errors = {k.removeprefix("err/"): int(v) for k, v in moved.items() if k.startswith("err/")}
    return {"condition": kind, "seconds": round(seconds, 1), "requests": len(answers),
            "failed": sum(not a.ok for a in answers if not apart(a)), "apart": sum(apart(a) for a in answers),
            "ttft_p50_ms": round(p50 * 1e3, 1),
            "ttft_p99_ms": round(p99 * 1e3, 1),
            "hit_ratio": round(sum(v for t, v in hits.items() if t != "engine") / prompt, 3) if prompt else None,
            "hit_by_tier": {t: round(v / prompt, 3) for t, v in hits.items()} if prompt else {},
            "tier_errors": errors}  # fmt: skip


def condition_table(rows: list[dict]) -> str:
    head = ("| condition | fault s | requests | failed | apart | TTFT p50 ms | TTFT p99 ms | hit ratio | by tier | "
            "tier errors |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        tiers = " ".join(f"{t} {v:.2f}" for t, v in sorted(r["hit_by_tier"].items()))
        errs = " ".join(f"{k} {v}" for k, v in sorted(r["tier_errors"].items()))
        ratio = "" if r["hit_ratio"] is None else f"{r['hit_ratio']:.2f}"
        lines.append(f"| {r['condition']} | {r['seconds']} | {r['requests']} | {r['failed']} | {r['apart']} | "
                     f"{r['ttft_p50_ms']} | "
                     f"{r['ttft_p99_ms']} | {ratio} | {tiers} | {errs} |")  # fmt: skip
    return "\n".join(lines)


def stall_table(result: SoakResult) -> str:
    """Each stall (`SoakResult.stalls`) with the faults around it (from `STALL_CONTEXT_S` before it to its end) and
    the requests it held; empty when there was none."""
    stalls = result.stalls()
    if not stalls:
        return ""
    lines = [f"Stalls: {STALL_WINDOW_S:.0f} s or more with requests outstanding and none answered (outside the "
             "server's restarts).", "",
             "| from s | to s | seconds | requests held | faults around it |", "|---:|---:|---:|---:|---|"]  # fmt: skip
    for t0, t1 in stalls:
        held = sum(a.t < t1 and a.t_end > t0 for a in result.answers)
        near = [f for f in result.faults if f.start_s <= t1 and f.end_s >= t0 - STALL_CONTEXT_S]
        faults = "; ".join(f"{f.kind} {f.start_s:.1f}-{f.end_s:.1f} s" for f in near) or "none"
        lines.append(f"| {t0:.1f} | {t1:.1f} | {t1 - t0:.1f} | {held} | {faults} |")
    return "\n".join(lines)


# ---- timeline -----------------------------------------------------------------------------------------------------
def windows(answers: list[Answer], width_s: float = 10.0) -> list[tuple[float, float, float]]:
    """(window start, TTFT p50, TTFT p99) per `width_s` window of the answers that completed."""
    by: dict[int, list[float]] = {}
    for a in answers:
        if a.ok and a.ttft_s is not None:
            by.setdefault(int(a.t // width_s), []).append(a.ttft_s)
    return [(k * width_s, *_pcts(v)) for k, v in sorted(by.items())]


COLORS = {"redis_kill": "red", "damage": "orange", "gc": "gray", "disk_full": "brown", "engine_kill": "purple",
          "server_term": "blue", "server_kill": "black"}  # fmt: skip


def plot_timeline(result: SoakResult, path: Path) -> str:
    """TTFT p50/p99 per 10 s window, the faults as spans, and the server's RSS on a second axis."""
    from kvprefetch.bench.plotting import figure, save

    fig, ax = figure()
    w = windows(result.answers)
    ax.plot([t for t, _, _ in w], [p * 1e3 for _, p, _ in w], "o-", label="TTFT p50")
    ax.plot([t for t, _, _ in w], [p * 1e3 for _, _, p in w], "s--", label="TTFT p99")
    for kind in dict.fromkeys(f.kind for f in result.faults):
        for i, f in enumerate(x for x in result.faults if x.kind == kind):
            ax.axvspan(f.start_s, max(f.end_s, f.start_s + 1.0), color=COLORS.get(kind, "gray"), alpha=0.25,
                       label=kind if i == 0 else None)  # fmt: skip
    for i, (t0, t1) in enumerate(result.stalls()):
        ax.axvspan(t0, t1, facecolor="none", edgecolor="red", hatch="//", label="stall" if i == 0 else None)
    ax.set_xlabel("seconds into the run (shaded: faults; hatched: stalls)")
    ax.set_ylabel("TTFT per 10 s window (ms)")
    ax.set_yscale("log")
    rss = ax.twinx()
    rss.plot([x.t for x in result.samples], [x.rss_mb for x in result.samples], color="green", alpha=0.6)
    rss.set_ylabel("server RSS (MiB, green)")
    return save(fig, ax, path, loc="upper left", fontsize=7, ncol=3)
