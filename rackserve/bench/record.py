"""One benchmark's results file: the result with the command that made it and the machine's state
(CPU count, load average), so a figure in bench/results can be traced and read against the load
it ran under. Torch-free, so benches that only drive servers stay light. Never measures."""
from __future__ import annotations

import json
import os
import sys
from typing import Any


def write_record(path: str, result: dict[str, Any], **extra: Any) -> None:
    """Write `result` (plus `extra` fields) to `path` as JSON, headed by the command line."""
    with open(path, "w") as f:
        json.dump({"command": "rackserve " + " ".join(sys.argv[1:]), **extra, "cpu_count": os.cpu_count(),
                   "load_average": os.getloadavg(), **result}, f, indent=2)
    print(f"wrote {path}")
