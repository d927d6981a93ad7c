"""`rackserve bench plot`: the upper frontier of throughput against interactivity, and the
figure written through the CLI for several systems."""
from __future__ import annotations

import json

import rackserve.bench.plot  # noqa: F401  (registers `bench plot`)
from rackserve.bench.plot import Point, frontier, points
from rackserve.serve.cli import main


def result(label: str, runs: list[tuple[int, float, float, bool]]) -> dict:
    return {"label": label, "workload": "agentx", "scale": 0.005, "runs": [
        {"concurrency": c, "summary": {"interactivity_p90": x, "throughput_per_device": y, "valid": valid}}
        for c, x, y, valid in runs]}


RUNS = [(1, 30.0, 100.0, True), (2, 25.0, 180.0, True), (4, 24.0, 150.0, True),   # c=4 is beaten by c=2
        (8, 10.0, 300.0, True), (16, 5.0, 400.0, False), (32, None, None, False)]


def test_frontier_keeps_points_nothing_beats_on_both_axes():
    pts = points(result("a", RUNS))
    assert len(pts) == 5                                    # a run without numbers has no point
    assert [p.concurrency for p in frontier(pts)] == [8, 2, 1]
    # An invalid run is drawn but never on the frontier.
    assert Point(5.0, 400.0, 16, False) in pts


def test_plot_command_writes_a_figure_of_several_systems(tmp_path):
    paths = []
    for label in ("rackserve", "llama.cpp"):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(result(label, RUNS)))
        paths.append(str(path))
    figure = tmp_path / "curve.png"
    assert main(["bench", "plot", *paths, "-o", str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
