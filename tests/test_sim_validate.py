"""`python -m rackserve.sim.validate`: the error of each figure at each level both results have,
and the machine each side ran on (CPU and load) beside the calibration that priced the simulation."""
from __future__ import annotations

import json

from rackserve.sim.validate import main


def result(concurrency_throughput_p90: list[tuple[int, float, float]], **extra) -> dict:
    return {**extra, "runs": [{"concurrency": c, "summary": {"throughput_per_device": t, "interactivity_p90": i,
                                                             "ttft": {"p50": 0.5}, "hit_rate": 0.9}}
                              for c, t, i in concurrency_throughput_p90]}


def test_validate_writes_errors_machines_and_calibration(tmp_path):
    machine = {"cpu": "AMD EPYC family 23 model 1 (avx2)", "cpu_count": 2, "load_average": [1.5, 1.2, 1.0]}
    measured = result([(1, 400.0, 50.0), (2, 800.0, 40.0)], machine=machine)
    simulated = result([(1, 440.0, 45.0), (4, 1.0, 1.0)], machine={**machine, "load_average": [0.5, 0.5, 0.5]},
                       sim={"calibration": "rackserve/sim/calibration/cpu-smollm2-gguf-zen1.json"})
    for name, data in (("m.json", measured), ("s.json", simulated)):
        (tmp_path / name).write_text(json.dumps(data))
    out = tmp_path / "v.json"
    assert main([str(tmp_path / "m.json"), str(tmp_path / "s.json"), "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    [row] = written["rows"]     # the one level both have
    assert row["concurrency"] == 1 and abs(row["throughput_per_device"]["error"] - 0.10) < 1e-12
    assert abs(row["interactivity_p90"]["error"] + 0.10) < 1e-12 and row["within_goal"]
    assert written["machine"]["measured"] == machine and written["machine"]["simulated"]["load_average"][0] == 0.5
    assert written["calibration"].endswith("cpu-smollm2-gguf-zen1.json")
