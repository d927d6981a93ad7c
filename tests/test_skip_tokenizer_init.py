"""--skip-tokenizer-init and LLM(skip_tokenizer_init=True), vLLM's token-ids-only mode: greedy
token ids against transformers on a tiny random Llama that has no tokenizer at all, through a
real `python -m rackserve serve` subprocess driven by the official `openai` client, and offline.
"""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.server_utils import start_server, stop_server
from tests.tiny_models import build_tiny_model, load_hf

MODEL = "tiny"
IDS = [42, 71, 299, 330, 374, 17, 250, 99]     # a token-id prompt, all inside the vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("bare_model"))


@pytest.fixture(scope="module")
def greedy_reference(model_dir) -> list[int]:
    """transformers' greedy continuation of IDS, 10 tokens, EOS ignored."""
    hf = load_hf(model_dir)
    ids = list(IDS)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(IDS):]


@pytest.fixture(scope="module")
def bare(model_dir, tmp_path_factory):
    """The model with no tokenizer at all."""
    proc, url = start_server(["--model", model_dir, "--served-model-name", MODEL, "--device", "cpu",
                              "--skip-tokenizer-init", "--max-model-len", "512", "--num-gpu-blocks-override", "64"],
                             tmp_path_factory.mktemp("bare") / "server.log")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stop_server(proc)


def test_skip_tokenizer_init_serves_token_ids(bare, greedy_reference):
    greedy = dict(model=MODEL, prompt=IDS, max_tokens=10, temperature=0.0)
    resp = bare.completions.create(**greedy)
    choice = resp.choices[0]
    assert choice.text == "" and choice.finish_reason == "length" and resp.usage.completion_tokens == 10
    assert choice.model_extra["token_ids"] == greedy_reference
    assert choice.model_extra["prompt_token_ids"] == IDS
    chunks = [c.choices[0] for c in bare.completions.create(**greedy, stream=True) if c.choices]
    assert chunks[0].model_extra["prompt_token_ids"] == IDS
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == greedy_reference
    logprobs = bare.completions.create(**greedy, logprobs=2).choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in greedy_reference]
    # With no EOS known, a stop token id is what ends a request early.
    stop_at = greedy_reference[3]
    stopped = bare.completions.create(**greedy, extra_body={"stop_token_ids": [stop_at]}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["token_ids"] == greedy_reference[:greedy_reference.index(stop_at) + 1]


def test_skip_tokenizer_init_refuses_text(bare):
    with pytest.raises(openai.BadRequestError, match="token ids"):
        bare.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="skip-tokenizer-init"):
        bare.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        bare.completions.create(model=MODEL, prompt=IDS, max_tokens=2, stop=["x"])
    base = str(bare.base_url).removesuffix("/v1/")
    assert httpx.post(f"{base}/tokenize", json={"prompt": "Hi"}).status_code == 400
    assert httpx.post(f"{base}/detokenize", json={"tokens": [1]}).status_code == 400


def test_llm_skip_tokenizer_init_matches_transformers(model_dir, greedy_reference):
    from rackserve import LLM, SamplingParams
    with LLM(model_dir, skip_tokenizer_init=True, device="cpu", max_model_len=256,
             num_gpu_blocks_override=32) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate({"prompt_token_ids": IDS}, SamplingParams(max_tokens=10, temperature=0.0))[0]
        assert out.outputs[0].token_ids == greedy_reference and out.outputs[0].text == ""
        with pytest.raises(ValueError, match="token ids"):
            llm.generate("Hello", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            llm.chat([{"role": "user", "content": "Hi"}])
        llm.engine.core.check_integrity()
