"""One benchmark's results file: the result with the command that made it and the machine's state
(CPU model and features, CPU count, load average), so a figure in bench/results can be traced and
read against the machine and the load it ran under. Torch-free, so benches that only drive servers
stay light. Never measures."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from rackserve.cpu_dtype import cpu_flags, cpu_identity


def cpu_name() -> str:
    """The CPU model (its family and model numbers too) and its wide-vector features (the same
    project runs on AMD Zen without AVX-512 and on Xeons with AMX, and a figure means little
    without knowing which)."""
    name = cpu_identity()
    flags = cpu_flags()
    features = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(features)})" if features else name


def machine_state() -> dict[str, Any]:
    """What every results file records about where it ran: CPU, CPU count, load average."""
    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}


def write_record(path: str, result: dict[str, Any], **extra: Any) -> None:
    """Write `result` (plus `extra` fields) to `path` as JSON, headed by the command line."""
    with open(path, "w") as f:
        json.dump({"command": "rackserve " + " ".join(sys.argv[1:]), **extra, **machine_state(), **result},
                  f, indent=2)
    print(f"wrote {path}")
