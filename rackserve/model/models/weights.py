"""From checkpoint tensors to parameters, for every model's `load_weights`: a model names the
checkpoint tensors that it stacks into one parameter (`stacked_params`: q_proj, k_proj and v_proj
into qkv_proj as shards "q", "k", "v"), each parameter's `weight_loader` copies its part, and a
`WeightTracker` makes sure every parameter got every shard it needs exactly once. A tensor named
`<module>.qweight` (a GGUF weight kept quantized) goes to that module's `load_quantized` and
counts as its `weight`.
"""
from __future__ import annotations

import torch
from torch import nn

StackedParams = dict[str, tuple[str, str]]     # checkpoint module name -> (parameter module, shard)


def stacked_target(name: str, stacked_params: StackedParams) -> tuple[str, object]:
    """The parameter a checkpoint tensor loads into, and its shard (None: the whole parameter)."""
    part = name.split(".")[-2] if "." in name else ""
    if part in stacked_params:
        fused, shard = stacked_params[part]
        return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def stacked_shards(param_name: str, stacked_params: StackedParams) -> set[object]:
    """The shards a parameter needs: all its stacked parts, or {None} for a plain one."""
    part = param_name.split(".")[-2] if "." in param_name else ""
    return {shard for fused, shard in stacked_params.values() if fused == part} or {None}


class WeightTracker:
    """Loads tensors into a model's parameters by name and records which shards each received."""

    def __init__(self, model: nn.Module):
        self.owner = type(model).__name__
        self.model = model
        self.params = dict(model.named_parameters())
        self.seen: dict[str, set[object]] = {}

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        if name.endswith(".qweight"):
            module = name[:-len(".qweight")]
            self.model.get_submodule(module).load_quantized(tensor, shard)
            self.seen.setdefault(f"{module}.weight", set()).add(shard)
            return
        if name not in self.params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {self.owner}")
        param = self.params[name]
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
        self.seen.setdefault(name, set()).add(shard)

    def check(self, name: str, want: set[object]) -> None:
        """Raises unless parameter `name` received exactly the shards `want`."""
        got = self.seen.get(name, set())
        if got != want:
            missing = sorted(want - got, key=str)[:4]
            raise ValueError(f"parameter {name!r} was not (fully) loaded: shards {missing} missing of {len(want)}")
