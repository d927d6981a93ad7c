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


def test_throughput_at_a_peers_interactivity_is_read_off_the_frontier_between_its_points():
    from rackserve.bench.curve_compare import along_curve, comparison_lines, throughput_at
    front = frontier(points(result("a", RUNS)))             # (10, 300), (25, 180), (30, 100)
    # Halfway between c=8 (10, 300) and c=2 (25, 180) in interactivity: halfway in throughput.
    assert throughput_at(front, 17.5) == (240.0, False)
    assert throughput_at(front, 30.0) == (100.0, False)     # a frontier point itself
    assert throughput_at(front, 31.0) is None               # faster per user than A ever ran
    # Slower per user than A's slowest valid point: A's top throughput, which A gives at 10 tok/s/user.
    assert throughput_at(front, 4.0) == (300.0, True)
    peer = points(result("b", [(1, 17.5, 60.0, True), (2, 31.0, 50.0, True), (4, 4.0, 150.0, True),
                               (8, 12.0, 90.0, False)]))
    rows = along_curve(points(result("a", RUNS)), peer)
    assert [(r.concurrency, r.ratio) for r in rows] == [(1, 4.0), (2, None), (4, 2.0)]  # invalid c=8 left out
    text = "\n".join(comparison_lines(result("a", RUNS), result("b", [(1, 17.5, 60.0, True)])))
    assert "c=1: 100.0 / 60.0 tok/s = 1.67x; 30.0 / 17.5 tok/s/user = 1.71x" in text
    assert "b c=1 at 17.5 tok/s/user: 240.0 / 60.0 tok/s = 4.00x" in text
