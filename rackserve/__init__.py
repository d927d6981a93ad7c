"""rackserve: a small, readable LLM serving system.

`from rackserve import LLM, SamplingParams` is the offline API (shaped as vLLM's). The package
root stays import-light: LLM (and with it torch) loads on first use, so the scheduler and the
simulator (rackserve.sim), and the router once it exists, can import rackserve.core without torch.
"""
from rackserve.outputs import CompletionOutput, RequestOutput
from rackserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from rackserve.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'rackserve' has no attribute {name!r}")
