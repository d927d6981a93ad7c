"""Start `rackserve serve` (or router, cluster, proxy) as a child process on a free port and wait
until it answers /health."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rackserve.distributed.parallel_state import free_port


def start_command(args: list[str], log_path: Path, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """(process, base URL) of `rackserve ARGS --port P` (any command that serves /health: serve,
    router, cluster, proxy) on a free port P, its output in log_path; the test fails with that log
    if it exits or does not come up within `timeout` s."""
    return start_commands([(args, log_path)], timeout)[0]


def start_commands(commands: list[tuple[list[str], Path]], timeout: float = 120) -> list[tuple[subprocess.Popen, str]]:
    """start_command for each (args, log path), all launched before any is waited for: their start-ups
    (imports, model loads: seconds of one core each) overlap on the machine's cores."""
    started = []
    for args, log_path in commands:
        port = free_port()
        with open(log_path, "w") as log:      # the child keeps its own descriptor
            proc = subprocess.Popen([sys.executable, "-m", "rackserve", *args, "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT)
        started.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + timeout
    try:
        for (proc, url), (args, log_path) in zip(started, commands):
            _wait_up(proc, url, args[0], log_path, deadline)
    except BaseException:
        for proc, _ in started:
            proc.kill()
        raise
    return started


def _wait_up(proc: subprocess.Popen, url: str, command: str, log_path: Path, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"`rackserve {command}` did not come up:\n{Path(log_path).read_text()}")
        time.sleep(0.2)


def start_server(flags: list[str], log_path: Path, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`rackserve serve` with these flags (see start_command)."""
    return start_command(serve_args(flags), log_path, timeout)


def serve_args(flags: list[str]) -> list[str]:
    """start_command's arguments for `rackserve serve` with these flags."""
    return ["serve", *flags, "--uvicorn-log-level", "warning"]


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, which must end the server promptly with exit code 0 (it is killed either way)."""
    proc.terminate()
    try:
        assert proc.wait(timeout=timeout) == 0
    finally:
        proc.kill()


def stop_all(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM every process, then wait for each (killed either way; a wait past `timeout`
    raises, so a child that ignores SIGTERM fails the test)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        finally:
            proc.kill()


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics samples: name with its labels -> value."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def metric_totals(url: str) -> dict[str, float]:
    """A server's /metrics by sample name, summed over label sets."""
    totals: dict[str, float] = {}
    for name, value in scrape_metrics(url).items():
        totals[name.split("{")[0]] = totals.get(name.split("{")[0], 0.0) + value
    return totals
