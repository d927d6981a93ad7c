"""Two systems' AgentX curves compared two ways: at the same concurrency (each axis's ratio), and
along the curve, the way the published rack figures are quoted ("58x GB300 at that interactivity"):
system A's throughput per device at system B's P90 interactivity, read off A's frontier, over B's.

At low concurrency a closed-loop workload's think time caps the plain throughput ratio (a lane
waits whatever the server's speed), so the same-concurrency ratio understates a faster server; the
along-the-curve ratio asks what throughput A gives at the per-user speed B gives.

This file owns the comparison arithmetic and its text; it never runs a benchmark nor draws.
"""
from __future__ import annotations

from typing import NamedTuple

from rackserve.bench.plot import Point, frontier, points


class AtInteractivity(NamedTuple):
    throughput: float       # tokens/s/device on the frontier at the asked interactivity
    lower_bound: bool       # True: the asked interactivity is below every frontier point, so this
                            # is the frontier's highest throughput, which A gives at a higher speed


def throughput_at(front: list[Point], interactivity: float) -> AtInteractivity | None:
    """The frontier's throughput at `interactivity`, linear between its two neighbouring points
    (the straight segments the curve is drawn with); None when the frontier never reached it."""
    if not front or interactivity > front[-1].interactivity:
        return None
    if interactivity <= front[0].interactivity:
        return AtInteractivity(front[0].throughput, interactivity < front[0].interactivity)
    for lo, hi in zip(front, front[1:]):
        if lo.interactivity <= interactivity <= hi.interactivity:
            share = (interactivity - lo.interactivity) / (hi.interactivity - lo.interactivity)
            return AtInteractivity(lo.throughput + share * (hi.throughput - lo.throughput), False)
    raise AssertionError("a sorted frontier covers every interactivity between its ends")


class AlongCurve(NamedTuple):
    concurrency: int                # B's level
    interactivity: float            # B's P90 interactivity there
    peer_throughput: float          # B's throughput per device there
    at: AtInteractivity | None      # A's frontier at that interactivity

    @property
    def ratio(self) -> float | None:
        return None if self.at is None else self.at.throughput / self.peer_throughput


def along_curve(a: list[Point], b: list[Point]) -> list[AlongCurve]:
    """For each valid point of B, A's throughput at B's interactivity (A's frontier only)."""
    front = frontier(a)
    return [AlongCurve(p.concurrency, p.interactivity, p.throughput, throughput_at(front, p.interactivity))
            for p in sorted(b, key=lambda p: p.concurrency) if p.valid and p.throughput > 0]


def comparison_lines(a: dict, b: dict) -> list[str]:
    """The text `bench plot` prints for A (the first results file) against B (another)."""
    name_a, name_b = a.get("label", "A"), b.get("label", "B")
    pa, pb = points(a), points(b)
    lines = [f"{name_a} against {name_b}, at the same concurrency (throughput / P90 interactivity):"]
    by_c = {p.concurrency: p for p in pb}
    for p in sorted(pa, key=lambda p: p.concurrency):
        q = by_c.get(p.concurrency)
        if q is None or q.throughput <= 0 or q.interactivity <= 0:
            continue
        flag = "" if p.valid and q.valid else " (a run is invalid)"
        lines.append(f"  c={p.concurrency}: {p.throughput:.1f} / {q.throughput:.1f} tok/s = "
                     f"{p.throughput / q.throughput:.2f}x; {p.interactivity:.1f} / {q.interactivity:.1f} "
                     f"tok/s/user = {p.interactivity / q.interactivity:.2f}x{flag}")
    lines.append(f"{name_a}'s throughput at {name_b}'s P90 interactivity (on {name_a}'s frontier):")
    for row in along_curve(pa, pb):
        if row.at is None:
            text = f"{name_a} never reached it"
        else:
            sign = ">= " if row.at.lower_bound else ""
            text = f"{sign}{row.at.throughput:.1f} / {row.peer_throughput:.1f} tok/s = {sign}{row.ratio:.2f}x"
        lines.append(f"  {name_b} c={row.concurrency} at {row.interactivity:.1f} tok/s/user: {text}")
    return lines
