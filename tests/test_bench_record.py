"""write_record: a results file carries the command that made it, the CPU count and the load
average it ran under, beside the result and any extra fields."""
from __future__ import annotations

import json

from rackserve.bench.record import write_record


def test_write_record(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["rackserve", "bench", "kv-pool", "--label", "x"])
    write_record(str(tmp_path / "r.json"), {"rows": [1, 2]}, label="x")
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["command"] == "rackserve bench kv-pool --label x" and record["label"] == "x"
    assert record["rows"] == [1, 2] and record["cpu_count"] >= 1 and len(record["load_average"]) == 3
