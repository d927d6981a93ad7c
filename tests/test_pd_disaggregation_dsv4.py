"""DeepSeek-V4 prefill/decode disaggregation through real processes: a prefill server and a decode
server of the tiny V4 model (KV cache groups: a 16-token window, CSA and HCA entries),
`rackserve proxy` in front, the official `openai` client. The prefiller prefills in chunks of 8,
so its window group gives blocks back while a long prompt runs and its kv_transfer_params carry
`null` for them over HTTP; the decoder pulls every group it needs. Greedy tokens must equal the
prefiller's own (prefix caching off there, so it computes each prompt whole), the decoder must
have loaded all but the last prompt token, and neither side may hold a block afterwards.
"""
from __future__ import annotations

import json
import time

import httpx
import openai

from tests.server_utils import metric_totals, serve_args, start_command, start_commands, stop_all

MODEL = "tiny-v4"
FIRST = [3 + (i * 7) % 500 for i in range(45)]     # 11 blocks and a partial one, past the window
PROMPTS = [FIRST, FIRST[:40] + [9, 8, 7, 6, 5, 4, 3], [5, 6, 7]]


def _kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"lease_seconds": 3.0, "transfer_timeout": 5.0}})


def _wait_kv_free(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric_totals(url)["rackserve:kv_cache_usage_perc"] > 0:
        assert time.monotonic() < deadline, f"{url} still holds KV blocks"
        time.sleep(0.05)


def test_deepseek_v4_through_the_proxy_matches_one_instance(tiny_deepseek_v4_kv_dir, tmp_path):
    base = ["--model", tiny_deepseek_v4_kv_dir, "--served-model-name", MODEL, "--device", "cpu", "--dtype",
            "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--block-size", "4"]
    procs = []
    try:
        roles = {"prefill": ["--max-num-batched-tokens", "8", "--no-enable-prefix-caching",
                             "--kv-transfer-config", _kv_config("kv_producer")],
                 "decode": ["--kv-transfer-config", _kv_config("kv_consumer")]}
        # Both start at once: a core each.
        started = start_commands([(serve_args(base + flags), tmp_path / f"{name}.log")
                                  for name, flags in roles.items()])
        procs += [proc for proc, _ in started]
        (_, prefill_url), (_, decode_url) = started
        proxy, proxy_url = start_command(["proxy", "--prefill", prefill_url, "--decode", decode_url,
                                          "--uvicorn-log-level", "warning"], tmp_path / "proxy.log", timeout=60)
        procs.append(proxy)

        # The window's null entries survive JSON: the prefiller's own params for the long prompt.
        held = httpx.post(f"{prefill_url}/v1/completions", json={
            "model": MODEL, "prompt": FIRST, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}, timeout=60).json()["kv_transfer_params"]
        window, csa, hca = held["remote_block_ids"]
        assert window[:6] == [None] * 6 and None not in window[-5:] + csa + hca   # never pulled: a lease frees it

        via, alone = (openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                      for url in (proxy_url, prefill_url))
        greedy = dict(model=MODEL, max_tokens=6, temperature=0.0, logprobs=1, extra_body={"ignore_eos": True})
        wants = []
        for k, prompt in enumerate(PROMPTS):
            got = via.completions.create(prompt=prompt, **greedy)
            wants.append(alone.completions.create(prompt=prompt, **greedy).choices[0])
            assert got.choices[0].logprobs.tokens == wants[k].logprobs.tokens, k
            # The decoder loaded every prompt token but the last (the second prompt's 40 shared
            # tokens partly from its own compressed blocks, the rest pulled).
            assert got.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1, k
        stream = via.completions.create(prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True},
                                        **greedy)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == wants[1].text
        assert chunks[-1].usage.completion_tokens == 6
        assert metric_totals(decode_url)["rackserve:external_prefix_cache_hits_total"] > 0
        for url in (prefill_url, decode_url):
            _wait_kv_free(url)
    finally:
        stop_all(procs)
