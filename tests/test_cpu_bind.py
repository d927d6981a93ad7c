"""--cpu-omp-threads-bind: the CPU list is parsed and checked like taskset's, and a served instance's
threads (torch's OpenMP pool, the server's and the engine's) all run on the CPUs it names, read
back from the kernel (/proc/PID/task/*/status)."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from rackserve.config import EngineArgs
from rackserve.executor.cpu_bind import format_cpu_list, parse_cpu_list
from tests.server_utils import start_server, stop_all
from tests.tiny_models import TINY_KV_CACHE_GIB


def test_cpu_lists_parse_and_print_like_the_kernels():
    assert parse_cpu_list("0") == (0,)
    assert parse_cpu_list("0-3,8,5") == (0, 1, 2, 3, 5, 8)
    assert format_cpu_list((0, 1, 2, 3, 5, 8)) == "0-3,5,8"
    for bad in ("", "a", "3-1", "1-", "0;1"):
        with pytest.raises(ValueError, match="cpu_omp_threads_bind"):
            parse_cpu_list(bad)


def test_cpus_this_process_cannot_use_are_refused_when_the_config_is_built():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"CPUs \[{missing}\] that this process cannot use"):
        EngineArgs(cpu_omp_threads_bind=str(missing), device="cpu").create_engine_config()


def _thread_cpus(pid: int) -> dict[int, str]:
    """Each thread of `pid`: its Cpus_allowed_list."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:   # ended meanwhile
            continue
        out[int(tid)] = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    return out


def test_every_thread_of_a_bound_instance_runs_on_its_cpus(tiny_llama_dir, tmp_path):
    cpu = str(max(os.sched_getaffinity(0)))
    proc, url = start_server(["--model", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--max-model-len", "128",
                              "--kv-cache-memory", str(TINY_KV_CACHE_GIB), "--cpu-omp-threads-bind", cpu], tmp_path / "serve.log")
    try:
        # A request first: the forward starts torch's thread pool, which must inherit the binding.
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3,
                                                          "temperature": 0.0}, timeout=60)
        assert reply.status_code == 200, reply.text
        threads = _thread_cpus(proc.pid)
        assert len(threads) > 2, threads
        assert set(threads.values()) == {cpu}, threads
    finally:
        stop_all([proc])
