"""`rackserve serve`'s process: build the engine and the app, run uvicorn, drain on SIGINT/SIGTERM,
and stop when the engine dies.

This file owns the server's lifetime: the startup banner, the drain (503 to new requests while
those in flight finish), and the exit code (0 after a requested stop, 1 when the engine died). It
must never define routes or parse requests (api_server.py does).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

import uvicorn

from rackserve.config import EngineArgs
from rackserve.engine.async_engine import AsyncEngine
from rackserve.engine.kv_event_publisher import KVEventPublisher
from rackserve.engine.llm_engine import EngineDeadError
from rackserve.serve.admission import Admission
from rackserve.serve.api_server import build_app
from rackserve.serve.http_server import server_config
from rackserve.serve.limits import ServerLimits
from rackserve.serve.metrics import PrometheusStatLogger
from rackserve.serve.signals import stop_signals_to

logger = logging.getLogger(__name__)


def run_server(args: argparse.Namespace) -> None:
    """Loads the model and serves until SIGINT/SIGTERM, then drains (see _Server) and exits 0.
    `args` holds the engine flags plus host, port, uvicorn_log_level, api_key, header_timeout and
    shutdown_timeout (see `rackserve serve`).
    If the engine dies (a step raised, a worker died) the server stops too and this raises
    SystemExit(1), so that whatever supervises it sees the failure."""
    engine_args = EngineArgs.from_cli_args(args)
    limits = ServerLimits.from_cli_args(args)
    config = engine_args.create_engine_config()
    stat_logger = PrometheusStatLogger(config.model.served_model_name)
    kv_publisher = None
    if config.kv_events is not None and config.kv_events.enable_kv_cache_events:
        kv_publisher = KVEventPublisher(config.kv_events, config.parallel.data_parallel_size)
    try:
        engine = AsyncEngine(engine_args, stat_loggers=[stat_logger] + ([kv_publisher] if kv_publisher else []),
                             max_waiting_requests=limits.max_waiting_requests)
    except BaseException:
        if kv_publisher is not None:
            kv_publisher.shutdown()
        raise
    died = None
    try:
        app = build_app(engine, stat_logger, limits, args.api_key, kv_publisher, args.header_timeout)
        config = server_config(app, args.host, args.port, args.uvicorn_log_level, args.header_timeout,
                               timeout_graceful_shutdown=3)
        # Once shut down, uvicorn re-raises the signal it caught to the handler it replaced; make
        # that one a no-op so we go on to stop the engine and exit 0 instead of dying mid-way.
        with stop_signals_to(lambda *_: None):
            died = asyncio.run(_serve(_Server(config, engine, app.state.admission, args.shutdown_timeout), engine))
    finally:
        engine.shutdown(args.shutdown_timeout)
        if kv_publisher is not None:
            kv_publisher.shutdown()
        if engine.stepping:   # requests are answered; only a step no one waits for is left
            _exit_under_step(0 if died is None else 1, args.shutdown_timeout)
    if died is not None:
        print(f"rackserve serve: {died}; exiting", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _exit_under_step(code: int, waited: float) -> None:
    """Ends the process now, without finalizing the interpreter: finalizing while the engine
    thread is inside torch aborts (rc -6) instead of exiting with `code`."""
    logging.shutdown()
    print(f"rackserve serve: the engine's step in progress did not end within {waited:g} s of the stop; "
          f"exiting without it", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class _Server(uvicorn.Server):
    """uvicorn's server, draining before it shuts down (SIGINT/SIGTERM): new requests get 503
    (/health too, so load balancers stop routing here) while those in flight run to their end for
    up to `shutdown_timeout` s (a second signal cuts that short). Then the engine stops, which ends
    what is left at once (a stream with an error event and [DONE]) instead of holding uvicorn's
    own grace period and being cancelled mid-response; its step in progress gets `shutdown_timeout`
    s more to end (run_server exits without one that does not)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, admission: Admission,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.admission, self.shutdown_timeout = engine, admission, shutdown_timeout

    async def shutdown(self, sockets: list | None = None) -> None:
        if self.admission.in_flight:
            logger.info("draining %d request(s) for up to %s s", self.admission.in_flight, self.shutdown_timeout)
        left = await self.admission.drain(self.shutdown_timeout, give_up=lambda: self.force_exit)
        if left:
            logger.warning("aborting %d request(s) still in flight at shutdown", left)
        # Off the event loop: the engine fails what is in flight at once, and the handlers must
        # answer (503) while its thread finishes the step in progress.
        await asyncio.to_thread(self.engine.shutdown, self.shutdown_timeout)
        await super().shutdown(sockets)


def kv_groups_line(engine: AsyncEngine) -> str:
    """The startup banner's line on a model with several KV cache groups: bytes per token per kind."""
    from rackserve.executor.kv_groups import describe
    kv_config = engine.engine.core.executor.kv_cache_config
    return "" if kv_config is None else f"  KV cache groups: {describe(kv_config)}\n"


def speculative_line(config) -> str:
    """The startup banner's line on speculative decoding, when it is on."""
    spec = config.speculative
    if spec is None:
        return ""
    off = "" if spec.disable_by_batch_size is None else f"; none while {spec.disable_by_batch_size}+ requests run"
    return (f"  speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} drafts a step from the last "
            f"{spec.prompt_lookup_max}..{spec.prompt_lookup_min} tokens{off}\n")


def kv_cache_line(config) -> str:
    """The startup banner's line on a CPU KV cache of another dtype than the model's: whether the
    native attention kernels read it (float16 and the 8-bit floats; bfloat16 in decode only) or the
    torch path gathers it."""
    from rackserve.bench.engine_kernels import engine_kernels
    m, kv = config.model, config.cache.cache_dtype
    if m.device != "cpu" or kv is None or kv == m.dtype:
        return ""
    how = "decode attention gathers it and runs SDPA (the torch path)"
    if engine_kernels(m, kv)["native_decode_attention"]:
        how = ("the native attention kernels read it in place, widened to float32" if kv != "bfloat16" else
               "the native decode attention reads it in place, widened to float32; prefill attention runs in torch")
    return f"  KV cache {kv} ({config.cache.cache_dtype_reason}): {how}\n"


async def _serve(server: uvicorn.Server, engine: AsyncEngine) -> EngineDeadError | None:
    """Runs the server until it is told to stop, or until the engine dies (returns why)."""
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        url = f"http://{server.config.host}:{server.config.port}"
        body = json.dumps({"model": engine.config.model.served_model_name,
                           "messages": [{"role": "user", "content": "Hello!"}]})
        m = engine.config.model
        print(f"rackserve: serving {engine.config.model.served_model_name} at {url}/v1 "
              f"(metrics at {url}/metrics)\n"
              f"  dtype {m.dtype} ({m.dtype_reason}); quantization {m.quantization}\n"
              + (f"  native library {m.native_isa} ({m.native_isa_reason})\n" if m.device == "cpu" else "")
              + (f"  quantized-linear kernel {m.quant_kernel} ({m.quant_kernel_reason})"
                 + (f"; activations {m.packed_activations} ({m.packed_activations_reason})"
                    if m.packed_activations != "two-part" else "") + "\n"
                 if m.quantization == "gguf" else "") +
              f"{kv_groups_line(engine)}{kv_cache_line(engine.config)}{speculative_line(engine.config)}"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
              flush=True)
    died = None
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        # Before a requested shutdown the engine only stops by dying; it has already failed the
        # requests in flight, and cannot serve again.
        if died is None and not server.should_exit:
            try:
                engine.check_health()
            except EngineDeadError as e:
                logger.error("%s; stopping the server", e)
                died, server.should_exit = e, True
    await task
    if died is None and engine.failure is not None:   # it died while draining: still a failure
        died = EngineDeadError(f"the engine failed: {engine.failure!r}")
    return died
