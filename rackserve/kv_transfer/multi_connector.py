"""MultiConnector: several KV connectors at once (e.g. MooncakeConnector for P/D plus
MooncakeStoreConnector for reuse), `kv_connector_extra_config: {"connectors": [{"kv_connector":
..., "kv_connector_extra_config": {...}}, ...]}` as in vLLM. Each child gets its own orders and
reports; a request's tokens are loaded by the first child, in the given order, that has them.

This file only fans calls out and results in; it never moves KV itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rackserve.config import EngineConfig, KVTransferConfig
from rackserve.core.request import Request
from rackserve.kv_transfer.base import (KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker,
                                        connector_class)


def child_configs(config: EngineConfig) -> list[EngineConfig]:
    children = config.kv_transfer.kv_connector_extra_config.get("connectors")
    if not children or not isinstance(children, list):
        raise ValueError("MultiConnector needs kv_connector_extra_config.connectors, a list of connector configs")
    out = []
    for child in children:
        child = {"kv_role": config.kv_transfer.kv_role, "engine_id": config.kv_transfer.engine_id,
                 "kv_load_failure_policy": config.kv_transfer.kv_load_failure_policy, **child}
        out.append(dataclasses.replace(config, kv_transfer=KVTransferConfig.from_json(child)))
    return out


@dataclass
class MultiKVConnectorOutput(KVConnectorOutput):
    parts: list[KVConnectorOutput] = field(default_factory=list)   # each child's own report

    @property
    def is_empty(self) -> bool:
        return all(part.is_empty for part in self.parts)


class MultiConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        super().__init__(config, dp_rank)
        self.children = [connector_class(c, 1)(c, dp_rank) for c in child_configs(config)]
        self._loader: dict[str, int] = {}   # req id -> the child loading it

    @classmethod
    def moves_kv_cache_groups(cls, config: EngineConfig) -> bool:
        return all(connector_class(c, 1).moves_kv_cache_groups(c) for c in child_configs(config))

    def set_kv_cache_config(self, kv_cache_config) -> None:
        super().set_kv_cache_config(kv_cache_config)
        for child in self.children:
            child.set_kv_cache_config(kv_cache_config)

    def validate_request(self, request: Request) -> None:
        for child in self.children:
            child.validate_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        for i, child in enumerate(self.children):
            n = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n:
                self._loader[request.request_id] = i
                return n
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_blocks: int,
                                 num_external_tokens: int) -> None:
        child = self.children[self._loader.pop(request.request_id)]
        child.update_state_after_alloc(request, block_ids, num_local_blocks, num_external_tokens)

    def request_scheduled(self, request: Request, block_ids: list[int]) -> None:
        for child in self.children:
            child.request_scheduled(request, block_ids)

    def build_connector_meta(self) -> list[Any]:
        return [child.build_connector_meta() for child in self.children]

    def has_pending_orders(self) -> bool:
        return any(child.has_pending_orders() for child in self.children)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        hold, params = False, None
        for child in self.children:
            child_hold, child_params = child.request_finished(request, block_ids)
            hold = hold or child_hold
            params = child_params or params
        return hold, params

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        assert isinstance(out, MultiKVConnectorOutput)
        for child, part in zip(self.children, out.parts):
            child.update_connector_output(part)


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0, dp_rank: int = 0):
        super().__init__(config, kv_cache, tp_rank, dp_rank)
        self.children = [connector_class(c, 2)(c, kv_cache, tp_rank, dp_rank) for c in child_configs(config)]

    def start_load_kv(self, metadata: list[Any] | None) -> None:
        for child, meta in zip(self.children, metadata or [None] * len(self.children)):
            child.start_load_kv(meta)

    def save_kv(self, metadata: list[Any] | None) -> None:
        for child, meta in zip(self.children, metadata or [None] * len(self.children)):
            child.save_kv(meta)

    def get_finished(self) -> KVConnectorOutput:
        parts = [child.get_finished() for child in self.children]
        out = MultiKVConnectorOutput(parts=parts)
        for part in parts:
            out.finished_sending |= part.finished_sending
            out.finished_recving |= part.finished_recving
            out.failed_recving |= part.failed_recving
            out.stats.add(part.stats)
        return out

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
