"""`rackserve router` and `rackserve proxy` in front of an instance take the same hostile inputs
as the instance itself (tests/test_server_hardening.py's list): each gets an OpenAI-format 4xx,
the front stays up and keeps its instance, and the next request is answered. Before, NaN,
invalid UTF-8, an empty or deeply nested body were 500s in the proxy, and a 10 MB prompt kept
the router's tokenizer busy long enough that its health checks dropped the instance."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server_utils import start_commands, start_server, stop_all
from tests.test_server_hardening import COMP, HOSTILE, MAX_MODEL_LEN, MODEL, VOCAB
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    root = tmp_path_factory.mktemp("front")
    model_dir = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB, max_position_embeddings=512)
    save_test_tokenizer(str(root / "tokenizer"), VOCAB)
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                         "replay_endpoint": "tcp://*:0", "topic": "kv"})
    procs = []
    try:
        proc, instance = start_server(["--model", model_dir, "--tokenizer", str(root / "tokenizer"),
                                       "--served-model-name", MODEL, "--device", "cpu", "--max-model-len",
                                       str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "128",
                                       "--kv-events-config", events], root / "instance.log")
        procs.append(proc)
        fronts = {"router": ["router", "--worker", instance],
                  "proxy": ["proxy", "--prefill", instance, "--decode", instance]}
        started = start_commands([([*args, "--uvicorn-log-level", "warning"], root / f"{name}.log")
                                  for name, args in fronts.items()], 60)
        urls = {name: url for name, (_, url) in zip(fronts, started)}
        procs += [proc for proc, _ in started]
        yield urls
    finally:
        stop_all(procs)


@pytest.mark.parametrize("front", ["router", "proxy"])
def test_hostile_input_through_a_front(fronts, front):
    url, wrong = fronts[front], []
    for name, (endpoint, body, status) in HOSTILE.items():
        if isinstance(body, (str, bytes)):
            resp = httpx.post(f"{url}/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"},
                              timeout=60)
        else:
            resp = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60)
        # The router refuses a 20 MB prompt by its length (400) before an instance could by its
        # size (413): both say why.
        error = resp.json().get("error") if resp.headers.get("content-type") == "application/json" else None
        if not (resp.status_code == status or (resp.status_code, status) == (400, 413)) or \
                not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
            wrong.append(f"{name}: {resp.status_code} {resp.text[:200]}")
    assert not wrong, "\n".join(wrong)
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", json=COMP, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
