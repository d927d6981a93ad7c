"""`rackserve router`: the router's flags and its server's life (uvicorn around RouterFront).

This file owns the command and its flags; it imports the router only when the command runs, so
`rackserve --help` stays instant.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from rackserve.router import MAX_ANSWER_BYTES
from rackserve.serve.cli import register_subcommand
from rackserve.serve.http_server import add_header_timeout_arg
from rackserve.serve.limits import ServerLimits

POLICIES = ("kv", "kv_prefill", "prefix", "least_load", "round_robin")   # router/policies.py's registry


def add_router_policy_args(parser: argparse.ArgumentParser, flag: str = "--policy") -> None:
    parser.add_argument(flag, default="kv", choices=POLICIES,
                        help="kv: least uncached prefill + active blocks (Dynamo); kv_prefill: kv's "
                             "uncached prefill alone (the least uncached work); prefix: SGLang's "
                             "cache-aware rule; least_load; round_robin")
    parser.add_argument("--overlap-weight", type=float, default=None,
                        help="kv policy: Dynamo's rule in blocks, this weight on uncached prefill blocks against "
                             "active blocks; unset: both priced in seconds learned from each instance's streams "
                             "(the request's predicted end-to-end time; weight 1 until learned)")
    parser.add_argument("--router-temperature", type=float, default=0.0,
                        help="kv policy: 0 takes the lowest cost; > 0 samples, softmax over -cost/T")


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd-threshold-tokens", type=int, default=256,
                        help="with P/D pools: prefill on a prefill worker only when at least this many prompt "
                             "tokens are not cached on the chosen decode worker, else run the request there "
                             "whole (llm-d's prefix-disaggregation decider, its nonCachedTokens)")


def add_health_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    parser.add_argument("--health-timeout", type=float, default=5.0,
                        help="seconds an instance may take to answer /health before it leaves the pool")
    parser.add_argument("--worker-api-key", default=None,
                        help="the instances' --api-key, sent on every call the router makes to them")


def add_body_args(parser: argparse.ArgumentParser, answers: bool = False) -> None:
    add_header_timeout_arg(parser)
    parser.add_argument("--max-request-body-bytes", type=int, default=ServerLimits().max_request_body_bytes,
                        help="largest request body, bytes; larger ones get 413 before they are read whole "
                             "(the instances' bound, `rackserve serve --max-request-body-bytes`)")
    if answers:
        parser.add_argument("--max-answer-bytes", type=int, default=MAX_ANSWER_BYTES,
                            help="largest whole (non-streaming) answer read from an instance, bytes; past it the "
                                 "client gets 502 and the read stops (the largest answer --max-logprob-entries "
                                 "admits is about 100 MB)")


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="an instance's base URL (rackserve serve), repeatable")
    parser.add_argument("--prefill-worker", action="append", default=[], metavar="URL",
                        help="a prefill instance (a kv_producer KV connector), repeatable; needs --decode-worker")
    parser.add_argument("--decode-worker", action="append", default=[], metavar="URL",
                        help="a decode instance (a kv_consumer KV connector), repeatable; needs --prefill-worker")
    add_pd_args(parser)
    add_router_policy_args(parser)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path (default: the one the first instance reports at /kv_events)")
    add_health_args(parser)
    add_body_args(parser, answers=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--log-level", default="warning", choices=["error", "warning", "info", "debug"],
                        help="the router's own log (debug: each kv decision that leaves the best-cached worker, "
                             "with every candidate's cost terms)")


def policy_options(args: argparse.Namespace, policy: str) -> dict:
    if policy in ("kv", "kv_prefill"):
        return {"overlap_weight": args.overlap_weight, "temperature": args.router_temperature}
    return {}


async def serve_router(args: argparse.Namespace, workers: list[str], policy: str,
                       started: "asyncio.Event | None" = None, prefill: list[str] = (),
                       decode: list[str] = ()) -> None:
    """Runs the router on args.host:args.port until the server is told to stop."""
    import uvicorn

    from rackserve.serve.http_server import server_config
    from rackserve.router.policies import create_policy
    from rackserve.router.router import Router
    from rackserve.router.app import build_router_app
    from rackserve.router.server import RouterFront

    router = Router(workers, create_policy(policy, **policy_options(args, policy)), args.health_interval,
                    args.health_timeout, args.worker_api_key, prefill, decode, args.pd_threshold_tokens)
    front = RouterFront(router, args.tokenizer, max_request_body_bytes=args.max_request_body_bytes,
                        max_answer_bytes=args.max_answer_bytes, header_timeout=args.header_timeout)
    try:
        config = server_config(build_router_app(front), args.host, args.port, args.uvicorn_log_level,
                               args.header_timeout)
        await front.start()
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"rackserve router: {policy} routing over {len(router.healthy)}/{len(router.instances)} instances "
                  f"at http://{args.host}:{args.port}/v1 (metrics at /metrics)", flush=True)
            if started is not None:
                started.set()
        await task
    finally:
        await router.close()


@register_subcommand("router", "route OpenAI requests over instances by their KV caches", _add_args)
def _router(args: argparse.Namespace) -> int:
    if bool(args.prefill_worker) != bool(args.decode_worker):
        print("rackserve router: --prefill-worker and --decode-worker come together", file=sys.stderr)
        return 2
    if not (args.worker or args.prefill_worker):
        print("rackserve router: give at least one --worker (or --prefill-worker and --decode-worker)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from rackserve.serve.signals import stop_quietly
    try:
        with stop_quietly():   # exit 0 on SIGTERM, not 143
            asyncio.run(serve_router(args, args.worker, args.policy, None, args.prefill_worker,
                                     args.decode_worker))
    except RuntimeError as e:
        print(f"rackserve router: {e}", file=sys.stderr)
        return 1
    return 0
