"""write_record: a results file carries the command that made it, the CPU it ran on (model and
features, as /proc/cpuinfo names them), the CPU count and the load average it ran under, beside the
result and any extra fields."""
from __future__ import annotations

import json

from rackserve.bench.record import cpu_name, write_record


def test_write_record(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["rackserve", "bench", "kv-pool", "--label", "x"])
    write_record(str(tmp_path / "r.json"), {"rows": [1, 2]}, label="x")
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["command"] == "rackserve bench kv-pool --label x" and record["label"] == "x"
    assert record["rows"] == [1, 2] and record["cpu_count"] >= 1 and len(record["load_average"]) == 3
    assert record["cpu"] == cpu_name() and record["cpu"]


def test_cpu_name_reads_the_model_and_the_wide_vector_features(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx2 fma\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    assert cpu_name() == "AMD EPYC 7B13 (avx2)"
    # Where the file numbers the family and model, they are part of the name: a Zen 1 and a Zen 3
    # VM both call themselves "AMD EPYC".
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
                       "flags\t\t: fpu avx2\n\nprocessor\t: 1\ncpu family\t: 99\nmodel\t\t: 9\n")
    assert cpu_name() == "AMD EPYC family 23 model 1 (avx2)"
