"""The details a client of a vLLM-shaped server relies on, against a real `python -m rackserve
serve` subprocess on a tiny random Llama: --api-key, X-Request-Id, /tokenize and /detokenize,
cache_salt, return_token_ids. The official `openai` client drives what it can send
(test_skip_tokenizer_init.py and test_server_shutdown.py cover the rest of the compatibility set).
"""
from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from tests.server_utils import start_server, stop_server
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

MODEL = "tiny"
VOCAB = 512
MAX_MODEL_LEN = 4096
KEY = "sk-test-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("compat_tokenizer"))
    save_test_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    """A server with an API key."""
    root = tmp_path_factory.mktemp("compat")
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB,
                             max_position_embeddings=MAX_MODEL_LEN)
    proc, url = start_server(["--model", model, "--tokenizer", tokenizer_dir, "--served-model-name", MODEL,
                              "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
                              "--num-gpu-blocks-override", "400", "--api-key", KEY], root / "server.log")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_python_m_rackserve_is_the_cli():
    out = subprocess.run([sys.executable, "-m", "rackserve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout and "generate" in out.stdout


def test_api_key_guards_all_but_health_metrics_version(server, client):
    assert client.models.list().data[0].max_model_len == MAX_MODEL_LEN
    for key in ("wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0).models.list()
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize")]:
        resp = httpx.request(method, server + path, json={"prompt": "Hi"})
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server + path).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_x_request_id_is_the_id_stem_and_echoed(client, chat, stream):
    def create(api, **kw):
        if chat:
            return api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, stream=stream, **kw)
        return api.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=stream, **kw)

    prefix = "chatcmpl-" if chat else "cmpl-"
    for sent in ("trace-7f3a/42", None):
        headers = {"X-Request-Id": sent} if sent else {}
        with create(client.with_streaming_response, extra_headers=headers) as raw:
            echoed = raw.headers["x-request-id"]
            body = raw.parse()
            ids = {chunk.id for chunk in body} if stream else {body.id}
        if sent:
            assert echoed == sent
        else:   # the server made one up, and still echoes it
            assert len(echoed) == 32
        assert ids == {prefix + echoed}
    with pytest.raises(openai.BadRequestError, match="X-Request-Id"):
        create(client, extra_headers={"X-Request-Id": "x" * 300})


def test_requests_sharing_an_x_request_id_both_run(client):
    same = {"X-Request-Id": "retry-of-the-same-call"}
    with client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, stream=True, extra_headers=same,
                                   extra_body={"ignore_eos": True}) as first:
        chunks = iter(first)
        head = next(chunks)                 # the first request is running now
        second = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_headers=same,
                                           extra_body={"ignore_eos": True})
        rest = list(chunks)
    assert second.id == head.id == "cmpl-retry-of-the-same-call" and second.usage.completion_tokens == 5
    assert rest[-1].choices[0].finish_reason == "length"


def test_tokenize_and_detokenize_in_vllm_shapes(tokenizer_dir, server, client):
    from transformers import PreTrainedTokenizerFast
    reference = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    text = "The quick brown fox, 日本語 🙂"
    resp = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": text}, headers=AUTH).json()
    assert resp == {"count": len(resp["tokens"]), "max_model_len": MAX_MODEL_LEN,
                    "tokens": reference.encode(text, add_special_tokens=True), "token_strs": None}
    strs = httpx.post(f"{server}/tokenize", json={"prompt": text, "return_token_strs": True}, headers=AUTH).json()
    assert strs["token_strs"] == reference.convert_ids_to_tokens(resp["tokens"])
    assert httpx.post(f"{server}/detokenize", json={"tokens": resp["tokens"]}, headers=AUTH).json() == {"prompt": text}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    chat = httpx.post(f"{server}/tokenize", json={"messages": messages}, headers=AUTH).json()
    rendered = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == reference.encode(rendered, add_special_tokens=False)
    # The count is what the chat endpoint will bill as the prompt.
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    bare = httpx.post(f"{server}/tokenize", json={"messages": messages, "add_generation_prompt": False},
                      headers=AUTH).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]


TOKENIZE_ERRORS = {   # name: (path, body, status, param)
    "id_outside_vocab": ("/detokenize", {"tokens": [5, VOCAB]}, 400, "tokens"),
    "negative_id": ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    "ids_not_ints": ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    "prompt_and_messages": ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400,
                            "prompt"),
    "neither": ("/tokenize", {}, 400, "prompt"),
    "unknown_model": ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    "unknown_role": ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, 400, "messages"),
    # Texts no context could hold are refused before they are tokenized whole.
    "prompt_past_any_context": ("/tokenize", {"prompt": "ab " * 400_000}, 400, "prompt"),
    "messages_past_any_context": ("/tokenize", {"messages": [{"role": "user", "content": "ab " * 400_000}]}, 400,
                                  "messages"),
}


@pytest.mark.parametrize("name", list(TOKENIZE_ERRORS))
def test_tokenize_errors(server, name):
    path, body, status, param = TOKENIZE_ERRORS[name]
    resp = httpx.post(server + path, json=body, headers=AUTH)
    assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text


def test_cache_salt_separates_prefix_cache_namespaces(client):
    prefix = "Paged attention splits the cache into blocks; each tenant keeps its own. " * 6

    def cached(tail: str, salt: str | None, chat: bool = False) -> int:
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})}
        if chat:
            resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prefix + tail}],
                                                  max_tokens=1, extra_body=extra)
        else:
            resp = client.completions.create(model=MODEL, prompt=prefix + tail, max_tokens=1, extra_body=extra)
        assert resp.usage.prompt_tokens > 64
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("one", "tenant-a") == 0
    assert cached("two", "tenant-a") >= 48           # whole 16-token blocks of the shared prefix
    assert cached("three", "tenant-b") == 0          # another salt never hits tenant-a's blocks
    assert cached("four", None) == 0                 # nor does an unsalted request
    assert cached("five", None) >= 48
    assert cached("six", "tenant-b") >= 48
    assert cached("seven", "tenant-c", chat=True) == 0
    assert cached("eight", "tenant-c", chat=True) >= 48
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("nine", "")



def test_return_token_ids_agree_with_tokenize_and_the_text(server, client):
    prompt = "def add(a, b):"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = client.completions.create(**kw).choices[0]
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": prompt}, headers=AUTH).json()["tokens"]
    assert choice.model_extra["prompt_token_ids"] == tokens and len(choice.model_extra["token_ids"]) == 12
    text = httpx.post(f"{server}/detokenize", json={"tokens": choice.model_extra["token_ids"]}, headers=AUTH)
    assert text.json()["prompt"] == choice.text
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert chunks[0].model_extra["prompt_token_ids"] == tokens
    assert all(c.model_extra["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == choice.model_extra["token_ids"]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0]
    assert plain.model_extra["token_ids"] is None and plain.model_extra["prompt_token_ids"] is None


def test_admission_compares_the_headers_bytes_with_the_key():
    from starlette.datastructures import Headers

    from rackserve.serve.admission import Admission
    admission = Admission("k€y")            # a header carries the key's UTF-8 bytes
    assert admission.refusal("/v1/models", Headers(raw=[(b"authorization", "Bearer k€y".encode())])) is None
    for sent in ("Bearer k€", "Bearer k€yy", "bearer k€y", "k€y"):
        assert admission.refusal("/v1/models", Headers(raw=[(b"authorization", sent.encode())])).status == 401
    assert admission.refusal("/metrics", Headers(raw=[])) is None
