"""`rackserve bench plot`: the AgentX figure from `bench serve` results: throughput per device
against P90 interactivity, one point per concurrency level, each system's upper frontier drawn,
several systems overlaid with a legend. Invalid runs are drawn hollow and left off the frontier.
With several files it also prints the first against each other one (curve_compare.py).

This file owns the figure. It must never run a benchmark nor recompute a metric.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import NamedTuple

from rackserve.serve.cli import register_subcommand


class Point(NamedTuple):
    interactivity: float                # P90, tokens/s/user
    throughput: float                   # tokens/s/device
    concurrency: int
    valid: bool


def points(result: dict) -> list[Point]:
    out = []
    for run in result["runs"]:
        s = run["summary"]
        x, y = s["interactivity_p90"], s["throughput_per_device"]
        if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
            out.append(Point(x, y, run["concurrency"], s["valid"]))
    return out


def frontier(pts: list[Point]) -> list[Point]:
    """The valid points that no other valid point matches or beats on both axes, by interactivity."""
    valid = [p for p in pts if p.valid]

    def beaten(p: Point) -> bool:
        return any(q.interactivity >= p.interactivity and q.throughput >= p.throughput
                   and (q.interactivity, q.throughput) != (p.interactivity, p.throughput) for q in valid)

    return sorted((p for p in valid if not beaten(p)), key=lambda p: p.interactivity)


def plot_results(results: list[dict], path: str, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")               # files only: no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, result in enumerate(results):
        color = f"C{index}"
        pts = points(result)
        front = frontier(pts)
        ax.plot([p.interactivity for p in front], [p.throughput for p in front], "-", color=color,
                label=result.get("label") or result.get("model", f"run {index}"))
        for p in pts:
            ax.plot(p.interactivity, p.throughput, "o", color=color, markerfacecolor=color if p.valid else "none")
            ax.annotate(f"c={p.concurrency}", (p.interactivity, p.throughput), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=color)
    ax.set_xlabel("P90 interactivity (tokens/s/user)")
    ax.set_ylabel("throughput per device (tokens/s)")
    first = results[0] if results else {}
    ax.set_title(title or f"{first.get('workload', '')} (scale {first.get('scale')}), "
                 "input + output tokens, cached input counted")
    ax.grid(True, alpha=0.3)
    ax.margins(0.2)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)            # long labels (a peer's flags) must not cover the points
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="JSON files written by bench serve --output")
    parser.add_argument("-o", "--output", default="curve.png", help="the figure (PNG, SVG or PDF)")
    parser.add_argument("--title", default=None)


@register_subcommand("bench plot", "plot bench serve results: throughput per device against P90 interactivity",
                     add_args)
def run(args: argparse.Namespace) -> int:
    results = []
    for path in args.results:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"rackserve bench plot: {path}: {e}", file=sys.stderr)
            return 1
    plot_results(results, args.output, args.title)
    print(f"wrote {args.output}")
    from rackserve.bench.curve_compare import comparison_lines
    for other in results[1:]:           # the first file against each other one
        print("\n".join(comparison_lines(results[0], other)))
    return 0
