"""CPU binding of an instance (`--cpu-omp-threads-bind`, vLLM's VLLM_CPU_OMP_THREADS_BIND as a
flag): the CPUs every thread of the instance's process runs on, so that instances sharing a
machine get cores of their own (a prefiller and a decoder each on its own core, as they would
each have their own GPU).

Binding happens before the executor loads the model: every thread the process has then is
bound, and every thread or worker process started later (torch's OpenMP pool, TP ranks) inherits
the mask from its creator. This file parses and applies the CPU list; it never decides how many
threads torch uses (OMP_NUM_THREADS / torch.set_num_threads do).
"""
from __future__ import annotations

import os
import threading


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8): the Linux cpulist format (taskset -c, /proc/PID/status)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpu_omp_threads_bind={text!r}: expected CPU ids like '0', '0-3' or '0-3,8'")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return tuple(sorted(cpus))


def check_cpus(cpus: tuple[int, ...]) -> None:
    """Raise ValueError for CPUs this process may not run on."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"cpu_omp_threads_bind names CPUs {missing} that this process cannot use "
                         f"(it may use {format_cpu_list(tuple(sorted(allowed)))})")


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def bind_process_threads(cpus: tuple[int, ...]) -> None:
    """Bind every thread of this process to `cpus` (sched_setaffinity acts on one thread: each
    one in /proc/self/task is bound, the calling one last so new threads inherit it)."""
    check_cpus(cpus)
    me = threading.get_native_id()
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        if tid != me:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:   # a thread that ended meanwhile
                pass
    os.sched_setaffinity(0, cpus)

