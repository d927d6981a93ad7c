"""Worker processes across machines and when they fail: two "nodes" on loopback (node 0 runs the
engine and rank 0, `rackserve worker --node-rank 1` hosts rank 1) give one process's tokens, and
refuse to start when their flags differ; a worker killed mid-generation, a worker on the other
node killed, and an exception inside the workers each make the engine raise WorkerError naming
the rank, promptly, and leave no worker behind; a TP=2 server answers its in-flight request with
an error and exits non-zero.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from rackserve import LLM, SamplingParams
from rackserve.core.outputs import CachedRequestData, SchedulerOutput
from rackserve.distributed.parallel_state import free_port
from rackserve.engine.llm_engine import EngineDeadError
from rackserve.executor.worker import WorkerError
from tests.server_utils import start_server
from tests.test_engine_parity import prompts_for, run

ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, num_gpu_blocks_override=128)
# Long enough that a kill 1 s in lands mid-generation, however fast the machine.
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
BOUND_S = 15.0   # a failure must surface within this long of the kill


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _children(pid: int) -> list[int]:
    """pid's child processes, whichever of its threads started them (a server starts its workers
    on the engine thread, whose task lists them, not the main thread's)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(p) for p in f.read().split()]
        except FileNotFoundError:       # the thread ended meanwhile
            pass
    return sorted(children)


def _worker_pids(pid: int) -> list[int]:
    """The spawned worker processes among pid's children (not multiprocessing's helpers)."""
    def cmdline(child: int) -> str:
        with open(f"/proc/{child}/cmdline") as f:
            return f.read()
    return [c for c in _children(pid) if "spawn_main" in cmdline(c)]


def _kill_later(pid: int, delay_s: float) -> list[float]:
    """SIGKILL pid after delay_s on a timer thread; the list receives the kill's time."""
    killed: list[float] = []

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())
    threading.Timer(delay_s, kill).start()
    return killed


def _cli_flags(model_dir: str, **options) -> list[str]:
    return [f"--model={model_dir}"] + [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]


def _start_node(model_dir: str, port: int, log_path, **overrides) -> subprocess.Popen:
    flags = _cli_flags(model_dir, tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=port,
                       **{**ENGINE, **overrides})
    return subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", "worker", *flags],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def test_two_nodes_on_loopback_match_one_process(tiny_llama_dir, tmp_path):
    with LLM(tiny_llama_dir, **ENGINE) as llm:
        prompts = prompts_for(llm.engine.core.executor.vocab_size)
        expected = run(llm, prompts)
    port = free_port()
    node1 = _start_node(tiny_llama_dir, port, tmp_path / "node1.log")
    try:
        with LLM(tiny_llama_dir, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port, **ENGINE) as llm:
            assert [w.rank for w in llm.engine.core.executor.workers] == [0], "node 0 hosts rank 0 only"
            assert run(llm, prompts) == expected
        # Node 0's shutdown reaches the other node's ranks, which leave cleanly.
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        node1.kill()


def test_nodes_started_with_other_flags_refuse_to_start(tiny_llama_dir, tmp_path):
    port = free_port()
    node1 = _start_node(tiny_llama_dir, port, tmp_path / "node1.log", max_num_seqs=7)
    try:
        with pytest.raises(WorkerError, match="rank 0: ValueError: a node was started with other engine flags"):
            LLM(tiny_llama_dir, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port, **ENGINE)
        assert node1.wait(timeout=30) == 1
        assert "scheduler.max_num_seqs: 64 on node 0, 7 here" in (tmp_path / "node1.log").read_text()
    finally:
        node1.kill()


def test_killed_worker_fails_generate_promptly(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE)
    workers = llm.engine.core.executor.workers
    killed = _kill_later(workers[1].process.pid, 1.0)
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died: killed by SIGKILL"):
        llm.generate([{"prompt_token_ids": p} for p in prompts_for(512)[:4]], LONG)
    assert killed and time.monotonic() - killed[0] < BOUND_S
    assert not any(w.process.is_alive() for w in workers), "the surviving worker must be stopped too"
    with pytest.raises(WorkerError):   # the executor stays dead, and says so at once
        llm.engine.core.executor.execute(SchedulerOutput([], [], {}, 0))
    with pytest.raises(EngineDeadError, match="rank 1"):   # so does the engine, naming the cause
        llm.generate({"prompt_token_ids": [1, 2, 3]}, LONG)
    llm.shutdown()


def test_exception_in_workers_is_reported(tiny_llama_dir):
    with LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE) as llm:
        executor = llm.engine.core.executor
        # A step for a request the workers never saw: every rank raises in its step.
        ghost = SchedulerOutput([], [CachedRequestData("ghost", [], 0)], {"ghost": 1}, 1)
        with pytest.raises(WorkerError, match=r"ranks 0, 1: KeyError: 'ghost'"):
            executor.execute(ghost)
        assert not any(w.process.is_alive() for w in executor.workers)


def test_worker_dying_on_the_other_node_fails_generate(tiny_llama_dir, tmp_path):
    port = free_port()
    node1 = _start_node(tiny_llama_dir, port, tmp_path / "node1.log")
    try:
        with LLM(tiny_llama_dir, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port, **ENGINE) as llm:
            killed = _kill_later(_worker_pids(node1.pid)[0], 1.0)
            # Rank 0's next collective with the dead rank fails, and rank 0 reports it.
            with pytest.raises(WorkerError, match=r"rank 0: RuntimeError"):
                llm.generate([{"prompt_token_ids": p} for p in prompts_for(512)[:4]], LONG)
            assert killed and time.monotonic() - killed[0] < BOUND_S
        assert node1.wait(timeout=30) == 1, (tmp_path / "node1.log").read_text()
    finally:
        node1.kill()


def test_server_fails_in_flight_request_and_exits_when_a_worker_dies(tiny_llama_dir, tmp_path):
    server, url = start_server([*_cli_flags(tiny_llama_dir, tensor_parallel_size=2, **ENGINE),
                                "--served-model-name=tiny"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=900, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))   # the request is in flight
        os.kill(_worker_pids(server.pid)[-1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="worker"):
            for _ in stream:
                pass
        while server.poll() is None:   # until it exits, a dead engine answers 503 everywhere
            try:
                assert httpx.get(f"{url}/health", timeout=2).status_code == 503
                refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=2)
                assert refused.status_code == 503 and "worker" in refused.json()["error"]["message"].lower()
            except httpx.TransportError:
                pass   # it stopped listening on its way out
            time.sleep(0.05)
        assert server.wait(timeout=BOUND_S) == 1
        assert time.monotonic() - killed < BOUND_S
    finally:
        server.kill()
        print((tmp_path / "server.log").read_text())
