"""A decode request's `kv_transfer_params` come from the client: each malformed one is refused
with a ValueError (a 400 on the server) before the scheduler or a transfer thread touches it, and
the engine goes on serving. A wrong `remote_port` type used to end the engine for every request."""
from __future__ import annotations

import pytest

from rackserve import LLM, SamplingParams
from rackserve.kv_transfer.mooncake_connector import check_remote_params

GOOD = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
        "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": 10}
BAD = {
    "missing field": {k: v for k, v in GOOD.items() if k != "remote_port"},
    "str port": {**GOOD, "remote_port": "abc"},
    "port out of range": {**GOOD, "remote_port": 70000},
    "bool port": {**GOOD, "remote_port": True},
    "str num tokens": {**GOOD, "remote_num_tokens": "10"},
    "float num tokens": {**GOOD, "remote_num_tokens": 1e308},
    "negative num tokens": {**GOOD, "remote_num_tokens": -1},
    "blocks not a list": {**GOOD, "remote_block_ids": 5},
    "str blocks": {**GOOD, "remote_block_ids": ["a", "b", "c"]},
    "negative block": {**GOOD, "remote_block_ids": [-5, 1, 2]},
    "too few blocks": {**GOOD, "remote_num_tokens": 10**30},
    "list engine id": {**GOOD, "remote_engine_id": ["e"]},
}


def test_check_remote_params():
    check_remote_params(GOOD, block_size=4)
    for name, params in BAD.items():
        with pytest.raises(ValueError, match="kv_transfer_params"):
            check_remote_params(params, block_size=4)


def test_engine_survives_malformed_params(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=32,
              block_size=4, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_both"})
    prompt = {"prompt_token_ids": list(range(5, 17))}
    for params in BAD.values():
        with pytest.raises(ValueError, match="kv_transfer_params"):
            llm.generate(prompt, SamplingParams(max_tokens=2, kv_transfer_params=params))
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    llm.engine.core.check_integrity()
