"""Prefill and decode pools behind the router: llm-d's decider and issue 8's two-hop flow.

For each request the router first picks a decode worker by load (policies.DecodeLoadPolicy; plain
`--worker`s count as decode workers that never disaggregate), then decides as llm-d's
prefix-disaggregation decider does: when the prompt's part not cached on that worker is at
least `--pd-threshold-tokens` (and a prefill worker is up), a prefill worker picked by the
router's policy (kv: least uncached work over the prefill pool's index) computes it with
max_tokens=1 and `do_remote_decode` (router/pd_proxy.py's `prefill_body`), and the decode
worker pulls its KV through the returned `kv_transfer_params`; otherwise the decode worker runs
the whole request. Each hop retries as the plain pool does (RouterFront.attempt); a request no
prefill worker could take runs whole on its decode worker instead. The decoder's usage counts
the whole request.

This file owns that decision and the order of the hops; it never sends HTTP itself (the front
does) and never changes the index.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from fastapi.responses import Response

from rackserve.router import BOTH, DECODE, PREFILL
from rackserve.router.pd_proxy import prefill_body

if TYPE_CHECKING:
    from rackserve.router.server import RouterFront

LOCAL, REMOTE = "local", "remote_prefill"      # the decider's two answers (a metric label)
logger = logging.getLogger(__name__)


def uncached_tokens(num_prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    return max(num_prompt_tokens - overlap_blocks * block_size, 0)


async def forward_disaggregated(front: RouterFront, path: str, body: dict, token_ids: list[int],
                                salt: str | None) -> Response:
    router = front.router
    decode = router.route(token_ids, cache_salt=salt, roles=(BOTH, DECODE), policy=router.decode_policy)
    if decode is None:
        return await front.attempt(path, body, token_ids, salt, (BOTH, DECODE), router.decode_policy)
    uncached = uncached_tokens(len(token_ids), decode.overlap_blocks, router.block_size or 0)
    role = router.instances[decode.worker.url].role
    if role == BOTH or uncached < router.pd_threshold_tokens or not router.workers((PREFILL,)):
        router.metrics.pd_decisions.labels(LOCAL).inc()
        return await front.attempt(path, body, token_ids, salt, (BOTH, DECODE), router.decode_policy, decode)
    prefill = await front.attempt(path, prefill_body(body), token_ids, salt, (PREFILL,))
    if prefill.status_code >= 500 or prefill.status_code == 429:   # no prefill worker took it
        router.metrics.pd_decisions.labels(LOCAL).inc()
        return await front.attempt(path, body, token_ids, salt, (BOTH, DECODE), router.decode_policy)
    if prefill.status_code != 200:   # a bad request is the prefiller's to refuse, in OpenAI's words
        return prefill
    answer = _json_object(prefill.body)
    if answer is None:   # not a prefiller's answer (not JSON, or not an object): the decoder runs it whole
        logger.warning("router: a prefill answer is not a JSON object (%r...); the request runs whole",
                       prefill.body[:80])
        router.metrics.pd_decisions.labels(LOCAL).inc()
        return await front.attempt(path, body, token_ids, salt, (BOTH, DECODE), router.decode_policy)
    router.metrics.pd_decisions.labels(REMOTE).inc()
    params = answer.get("kv_transfer_params")
    # Only decode workers can pull; any of them can (the prefiller holds the blocks for a lease).
    return await front.attempt(path, {**body, "kv_transfer_params": params}, token_ids, salt, (DECODE,),
                               router.decode_policy, decode)


def _json_object(data: bytes) -> dict | None:
    try:
        answer = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return answer if isinstance(answer, dict) else None
