"""The router's HTTP face: the FastAPI app around RouterFront (server.py): the OpenAI endpoints,
each answered by a forward the client's hang-up cancels (a body past --max-request-body-bytes
gets a 413 before it is read whole), and the pool's state and metrics
(/v1/models, /health, /router, /metrics).

This file never routes and never talks to an instance about a request (server.py does).
"""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response

from rackserve.router.router import Instance, Router
from rackserve.router.server import RouterFront, error_response
from rackserve.serve.request_body import read_body, read_within
from rackserve.serve.serving_engine import CLIENT_CLOSED_REQUEST, OpenAIError, unless_client_leaves


def build_router_app(front: RouterFront) -> FastAPI:
    router = front.router
    app = FastAPI(title="rackserve router")

    async def respond(raw: Request, path: str) -> Response:
        """The forwarded answer, unless the client leaves first: then the forward is cancelled,
        which closes the connection to the instance, which aborts the request there."""
        try:
            body = await read_body(raw, front.max_request_body_bytes, front.header_timeout)
        except OpenAIError as e:   # 413: past --max-request-body-bytes; 408: past --header-timeout
            return error_response(e)
        response = await unless_client_leaves(raw, front.forward(path, body))
        if response is None:
            router.metrics.client_disconnects.inc()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return response

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await respond(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await respond(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        for instance in router.healthy:
            try:
                async with router.session.get(f"{instance.url}/v1/models", timeout=front.timeout) as resp:
                    data = await read_within(resp.content.iter_chunked(1 << 16), front.max_answer_bytes,
                                             None, resp.content_length)
                    if data is not None:
                        return Response(data, status_code=resp.status, media_type=resp.content_type)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return error_response(OpenAIError("no instance is available", 503, type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if router.healthy:
            return Response(status_code=200)
        return error_response(OpenAIError("no instance is available", 503, type="server_error"))

    @app.get("/router")
    async def state() -> dict[str, Any]:
        """The pool as the router sees it: health, DP ranks, index size and predicted load."""
        return {"policy": router.policy.name, "instances": [_describe(router, i) for i in router.instances.values()]}

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.index_blocks.set(router.index.num_blocks())
        return Response(router.metrics.exposition(), media_type=router.metrics.content_type)

    return app


def _describe(router: Router, instance: Instance) -> dict[str, Any]:
    """A worker's price is what the kv policy learned it costs (router/pricing.py), if it has one."""
    workers = []
    for w in instance.workers:
        price = router.loads.price(w)
        workers.append({"dp_rank": w.dp_rank, "index_blocks": router.index.num_blocks(w), **vars(router.loads.get(w)),
                        "price": vars(price) if price else None})
    return {"url": instance.url, "healthy": instance.healthy, "workers": workers}
