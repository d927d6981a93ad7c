"""`rackserve proxy`: the prefill/decode front. An OpenAI-compatible server that sends each request
to a prefiller with max_tokens=1 and `kv_transfer_params: {"do_remote_decode": true}`, then the
same request to a decoder with the prefiller's returned kv_transfer_params, and relays the
decoder's answer (streamed or whole; its usage counts the whole request, since the decoder holds
the whole prompt). A client that hangs up ends the hop in progress (the instance then aborts the
request) and the next hop never starts. Prefillers and decoders are each picked round-robin; `rackserve router
--prefill-worker ... --decode-worker ...` (router/disagg.py) runs the same flow with KV-aware
choices and llm-d's decider, reusing `prefill_body`.

An instance's whole answer is read to at most --max-answer-bytes (a 502 past it), and a prefill
answer that is not a JSON object is a 502 (the router's P/D flow runs such a request whole on its
decoder instead). This file owns the two-hop request flow only. It never touches KV (the
instances' KV connectors move it) and never imports torch or the engine.
"""
import argparse
import contextlib
import itertools
import json
from typing import Any

from rackserve.router import MAX_ANSWER_BYTES
from rackserve.router.body import parse_body
from rackserve.router.cli import add_body_args
from rackserve.serve.cli import register_subcommand
from rackserve.serve.http_server import HEADER_TIMEOUT_S
from rackserve.serve.limits import ServerLimits
from rackserve.serve.request_body import declared_length, read_body, read_within
from rackserve.serve.serving_engine import CLIENT_CLOSED_REQUEST, SSE_DONE, OpenAIError, unless_client_leaves

PREFILL_TIMEOUT_S = 600.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as a prefiller gets it: one token, whole, one sample, KV kept for a decoder."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    return out


def _unreachable(e: Exception) -> OpenAIError:
    """What the client hears when an instance cannot be reached, fails or times out (a 502)."""
    return OpenAIError(f"an instance behind the proxy failed: {e!r}", 502, type="server_error")


def build_app(prefill_urls: list[str], decode_urls: list[str],
              max_request_body_bytes: int = ServerLimits().max_request_body_bytes,
              max_answer_bytes: int = MAX_ANSWER_BYTES, header_timeout: float = HEADER_TIMEOUT_S):
    # This module has no `from __future__ import annotations`: FastAPI reads the handlers'
    # annotations as objects, and Request is imported here, not at module level.
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefillers, decoders = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    # No cap on connections (httpx's default is 100): each stream holds one for its whole length,
    # and past the cap requests and /health's checks waited inside the proxy.
    client = httpx.AsyncClient(timeout=httpx.Timeout(PREFILL_TIMEOUT_S, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def whole(resp: httpx.Response) -> bytes:
        """`resp`'s body, read to at most max_answer_bytes (a 502 past it); closes `resp`."""
        try:
            data = await read_within(resp.aiter_bytes(), max_answer_bytes, PREFILL_TIMEOUT_S,
                                     declared_length(resp.headers.get("content-length")))
        finally:
            await resp.aclose()
        if data is None:
            raise OpenAIError(f"an instance's answer ran past --max-answer-bytes {max_answer_bytes}", 502,
                              type="server_error")
        return data

    async def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        resp = await client.send(client.build_request("POST", url, json=body), stream=True)
        return resp.status_code, await whole(resp)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    app = FastAPI(title="rackserve P/D proxy", lifespan=lifespan)

    async def two_hops(path: str, request: Request) -> Response:
        try:
            body = parse_body(await read_body(request, max_request_body_bytes, header_timeout))
        except OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        # A client that leaves during a hop cancels it, which closes the connection to that
        # instance, which aborts the request there: no prefill (or decode) for nobody, and no
        # blocks held for a decoder the proxy will never call.
        response = await unless_client_leaves(request, _answer(path, body))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response

    async def _answer(path: str, body: dict[str, Any]) -> Response:
        try:
            return await _two_hops(path, body)
        except (httpx.HTTPError, TimeoutError, ValueError, RecursionError) as e:   # an instance down, too
            return JSONResponse(_unreachable(e).body(), status_code=502)         # slow, or not JSON
        except OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status)

    async def _two_hops(path: str, body: dict[str, Any]) -> Response:
        status, content = await post(next(prefillers) + path, prefill_body(body))
        if status != 200:   # a bad request is the prefiller's to refuse, as is
            return Response(content, status, media_type="application/json")
        answer = json.loads(content)
        if not isinstance(answer, dict):
            raise OpenAIError(f"a prefill instance answered {content[:80]!r}..., not a JSON object", 502,
                              type="server_error")
        decode_body = dict(body, kv_transfer_params=answer.get("kv_transfer_params"))
        url = next(decoders) + path
        if not body.get("stream"):
            status, content = await post(url, decode_body)
            return Response(content, status, media_type="application/json")
        upstream = await client.send(client.build_request("POST", url, json=decode_body), stream=True)
        if upstream.status_code != 200:
            return Response(await whole(upstream), upstream.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:   # the decoder died mid-stream: an error event ends the stream
                yield f"data: {json.dumps(_unreachable(e).body())}\n\n{SSE_DONE}".encode()
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await two_hops("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await two_hops("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            reply = await client.send(client.build_request("GET", decode_urls[0] + "/v1/models"), stream=True)
            return Response(await whole(reply), reply.status_code, media_type="application/json")
        except (httpx.HTTPError, TimeoutError) as e:
            return JSONResponse(_unreachable(e).body(), status_code=502)
        except OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> Response:
        for url in prefill_urls + decode_urls:
            try:
                if (await client.get(url + "/health", timeout=5.0)).status_code != 200:
                    return Response(status_code=503)
            except httpx.TransportError:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance (rackserve serve with a KV connector); repeat for more")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance; repeat for more")
    add_body_args(parser, answers=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


@register_subcommand("proxy", "prefill/decode disaggregation front: prefill on one instance, decode on another",
                     _add_args)
def _proxy(args: argparse.Namespace) -> None:
    import uvicorn
    from rackserve.serve.http_server import server_config
    from rackserve.serve.signals import stop_quietly
    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    app = build_app(*strip, args.max_request_body_bytes, args.max_answer_bytes, args.header_timeout)
    with stop_quietly():   # exit 0 on SIGTERM, not 143
        uvicorn.Server(server_config(app, args.host, args.port, args.uvicorn_log_level, args.header_timeout)).run()
