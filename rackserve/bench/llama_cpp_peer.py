"""The llama.cpp peer: the same GGUF file run by llama.cpp (through llama-cpp-python, built as
docs/benchmarks.md says) on the same prompt ids and threads, timed in the same run as rackserve.

This file owns loading the peer and timing it; it never touches rackserve's engine. llama-cpp-python
is a benchmark-only dependency: a clear error says how to get it when it is missing.
"""
from __future__ import annotations

import time

from rackserve.config import resolve_model_path


def load_llama_cpp(model: str, threads: int, n_ctx: int):
    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise ValueError(f"the llama.cpp peer runs GGUF files only, got {path}")
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise SystemExit(f"--peer llama.cpp needs llama-cpp-python ({e}); build it as docs/benchmarks.md says") from e
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                 verbose=False)


def llama_cpp_stream_timing(llm, prompt_ids: list[int], max_new_tokens: int) -> tuple[float, float]:
    """One stream, greedy and past EOS: (TTFT seconds, decode tokens/s after the first token)."""
    times = []
    # generate(reset=True) still keeps the longest prefix the cache shares with the prompt (all but
    # its last token for a repeated prompt); reset() first, so every prompt is prefilled whole.
    llm.reset()
    t0 = time.perf_counter()
    # generate() yields each sampled token and never stops on its own.
    for _ in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == max_new_tokens:
            break
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0])
