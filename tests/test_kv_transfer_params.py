"""A decode request's `kv_transfer_params` come from the client: each malformed one is refused
with a ValueError (a 400 on the server) before the scheduler or a transfer thread touches it, and
the engine goes on serving. A wrong `remote_port` type used to end the engine for every request."""
from __future__ import annotations

import dataclasses

import pytest

from rackserve import LLM, SamplingParams
from rackserve.config import KVTransferConfig
from rackserve.kv_transfer.base import KV_CONNECTORS, KVConnectorScheduler, connector_class, \
    create_kv_connector_scheduler
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


class _OneGroupConnector(KVConnectorScheduler):
    """A connector that moves one cache group only (the base's default)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0

    def update_state_after_alloc(self, request, block_ids, num_local_blocks, num_external_tokens):
        pass

    def build_connector_meta(self):
        return None


def test_a_connector_that_moves_one_cache_group_is_refused_for_several(tiny_llama_dir, monkeypatch):
    from rackserve.config import EngineArgs
    from rackserve.core.kv_cache_groups import KVCacheConfig, KVCacheGroup
    monkeypatch.setitem(KV_CONNECTORS, "OneGroup", (__name__, "_OneGroupConnector", "_OneGroupConnector"))
    config = EngineArgs(model=tiny_llama_dir, device="cpu", kv_transfer_config={"kv_connector": "OneGroup"}) \
        .create_engine_config()
    groups = KVCacheConfig((KVCacheGroup("window", 4, 8, 1.0, sliding_window=7), KVCacheGroup("csa", 4, 8, 1.0)), 8, 2)
    assert create_kv_connector_scheduler(config).kv_cache_config is None   # one group: fine
    with pytest.raises(ValueError, match="OneGroup moves one KV cache group"):
        create_kv_connector_scheduler(config, 0, groups)
    for name in ("MooncakeConnector", "MooncakeStoreConnector", "OffloadingConnector"):
        assert connector_class(dataclasses.replace(config, kv_transfer=KVTransferConfig(name)), 1) \
            .moves_kv_cache_groups(config)


def test_params_of_a_model_with_cache_groups_name_one_list_per_group():
    grouped = {**GOOD, "remote_block_ids": [[None, None, 7], [1, 2, 3], [4]], "remote_num_tokens": 10}
    check_remote_params(grouped, block_size=4, group_block_sizes=[4, 4, 16])
    with pytest.raises(ValueError, match="3 lists, one per KV cache group"):
        check_remote_params(GOOD, block_size=4, group_block_sizes=[4, 4, 16])
    with pytest.raises(ValueError, match="too few"):
        check_remote_params({**grouped, "remote_block_ids": [[7], [1, 2, 3], [4]]}, 4, [4, 4, 16])
    with pytest.raises(ValueError, match="non-negative integers"):   # null only where groups allow it
        check_remote_params({**GOOD, "remote_block_ids": [None, 1, 2]}, block_size=4)
