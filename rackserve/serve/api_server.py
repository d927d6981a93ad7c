"""The OpenAI-compatible HTTP app: routes, request parsing and error bodies around one
AsyncEngine (serve/launch.py runs it under uvicorn).

This file owns the HTTP contract: every refused request gets a 4xx with an OpenAI error body
and the server keeps serving (413 past --max-request-body-bytes, 429 with Retry-After when the
waiting queue is full); a request that fails alone gets a 500 and the others go on; a dead engine
answers 503 everywhere until the server exits; a client that goes away cancels its handler, which
aborts its engine requests. It must never sample, schedule or shape completion bodies (serving_*.py do).
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rackserve import __version__
from rackserve.engine.async_engine import AsyncEngine
from rackserve.engine.kv_event_publisher import KVEventPublisher
from rackserve.engine.llm_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from rackserve.serve.admission import Admission, AdmissionMiddleware
from rackserve.serve.http_server import HEADER_TIMEOUT_S
from rackserve.serve.limits import ServerLimits
from rackserve.serve.metrics import PrometheusStatLogger
from rackserve.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from rackserve.serve.request_body import parse_request, read_body
from rackserve.serve.serving_chat import OpenAIServingChat
from rackserve.serve.serving_completion import OpenAIServingCompletion
from rackserve.serve.serving_engine import CLIENT_CLOSED_REQUEST, OpenAIError, unless_client_leaves
from rackserve.serve.serving_tokenization import (DetokenizeRequest, OpenAIServingTokenization,
                                                  TokenizeRequest)

logger = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 1                 # what a 429 asks a client to wait


def build_app(engine: AsyncEngine, stat_logger: PrometheusStatLogger,
              limits: ServerLimits | None = None, api_key: str | None = None,
              kv_publisher: KVEventPublisher | None = None, header_timeout: float = HEADER_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving `engine`; `stat_logger` (and `kv_publisher`, when KV events are on)
    must be among the engine's stat loggers. Its door (`app.state.admission`, see admission.py)
    checks `api_key` when one is given. A body must arrive within `header_timeout` s (408)."""
    limits = limits or ServerLimits()

    async def body(raw: Request) -> bytes:
        return await read_body(raw, limits.max_request_body_bytes, header_timeout)

    model_name = engine.config.model.served_model_name
    max_messages = {"max_messages": engine.config.model.max_model_len}   # parse_request's context
    completions = OpenAIServingCompletion(engine, model_name, limits)
    chat = OpenAIServingChat(engine, model_name, limits)
    tokenization = OpenAIServingTokenization(engine, model_name, limits)
    app = FastAPI(title="rackserve", version=__version__)
    app.state.admission = Admission(api_key)
    app.add_middleware(AdmissionMiddleware, admission=app.state.admission)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return JSONResponse(OpenAIError(str(e), status=503, type="server_error").body(), status_code=503)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, e: EngineOverloadedError) -> JSONResponse:
        body = OpenAIError(str(e), status=429, type="rate_limit_error", code="server_overloaded").body()
        return JSONResponse(body, status_code=429, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, e: RequestFailedError) -> JSONResponse:
        body = OpenAIError(f"this request failed (the server goes on): {e}", status=500,
                           type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        body = OpenAIError(str(e.detail), status=e.status_code).body()
        return JSONResponse(body, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("request failed")
        body = OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as e:
            return JSONResponse(OpenAIError(str(e), status=503, type="server_error").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=model_name, root=engine.config.model.model,
                         max_model_len=engine.config.model.max_model_len)
        return _json(ModelList(data=[card]))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.exposition(), media_type=stat_logger.content_type)

    @app.get("/kv_events")
    async def kv_events() -> dict[str, Any]:
        """What a router needs to follow this instance's prefix cache, given only its URL."""
        return kv_events_info(engine.config, kv_publisher)

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        request = parse_request(CompletionRequest, await body(raw))
        return await _respond(raw, completions.create_completion(request, raw.state.request_id))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        request = parse_request(ChatCompletionRequest, await body(raw), max_messages)
        return await _respond(raw, chat.create_chat_completion(request, raw.state.request_id))

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        request = parse_request(TokenizeRequest, await body(raw), max_messages)
        return _json(await tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        request = parse_request(DetokenizeRequest, await body(raw))
        return _json(await tokenization.detokenize(request))

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, plus the request bodies of the POST routes: they parse raw bodies
    themselves (for OpenAI-format errors), so FastAPI cannot see their schemas. Clients and
    schema fuzzers (schemathesis, in the tests) read them here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/completions", CompletionRequest),
                            ("/v1/chat/completions", ChatCompletionRequest),
                            ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


def kv_events_info(config: Any, publisher: KVEventPublisher | None) -> dict[str, Any]:
    """Endpoints per DP rank (a wildcard host means: this instance's host), topic, and how blocks
    are named (core/hashing.py: chained 64-bit BLAKE2b from root_hash(hash_seed))."""
    pubs = publisher.publishers if publisher is not None else []
    return {"enable_kv_cache_events": publisher is not None, "tokenizer": config.model.tokenizer,
            "served_model_name": config.model.served_model_name,
            "endpoints": [p.endpoint for p in pubs], "replay_endpoints": [p.replay_endpoint for p in pubs],
            "topic": publisher.config.topic if publisher is not None else None,
            "block_size": config.cache.block_size, "hash_scheme": "rackserve-blake2b64-chained", "hash_seed": 0,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "data_parallel_size": config.parallel.data_parallel_size,
            "max_model_len": config.model.max_model_len}


async def _respond(raw: Request, handler: Awaitable[bytes | AsyncIterator[str]]) -> Response:
    """Runs a handler until it answers or its client disconnects (then the handler is cancelled,
    which aborts its engine requests). A whole answer comes as JSON text (built off the loop);
    a streaming answer has already seen its first token."""
    result = await unless_client_leaves(raw, handler)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, bytes):
        return Response(result, media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream")


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")
