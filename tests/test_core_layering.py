"""The layering rule that lets the router and the simulator reuse the scheduler: core/ imports no
torch and nothing from the layers above it."""
import subprocess
import sys


def test_core_imports_no_torch_and_nothing_above_it():
    code = ("import sys, rackserve.core.scheduler, rackserve.core.kv_cache_manager, rackserve.core.hashing; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('rackserve.engine', "
            "'rackserve.executor', 'rackserve.model', 'rackserve.serve', 'fastapi'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
