"""The HF transformers peer: the same checkpoint loaded by transformers, timed on the same work in
the same run, so benchmark ratios compare like with like on a shared machine.

This file owns loading the peer and timing it; it never touches rackserve's engine.
"""
from __future__ import annotations

import os
import time

import torch

from rackserve.config import resolve_model_path


def best_cpu_dtype() -> torch.dtype:
    """The peer's best dtype on this CPU, measured: bf16 where the CPU computes it natively
    (cpu_dtype.py's rule for weights no native int8 kernel multiplies). transformers warns that its
    packed GGUF kernels compute in float32, yet on a Zen 5 with avx512_bf16 it decoded SmolLM2's
    GGUF 1.78x faster in bf16 in one interleaved run (bench/hf_peer_dtype.py; docs/benchmarks.md,
    sixteenth round)."""
    from rackserve.cpu_dtype import choose_cpu_dtype, cpu_flags
    return getattr(torch, choose_cpu_dtype(cpu_flags()).dtype)


def load_hf_model(model: str, dtype: torch.dtype | None = None):
    """transformers' own loading of a .gguf file or an HF directory, in `dtype` (default:
    best_cpu_dtype())."""
    import transformers
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        kwargs = dict(gguf_file=os.path.basename(path))
        path = os.path.dirname(path)
    else:
        kwargs = {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or best_cpu_dtype(), **kwargs).eval()


class _TokenTimes:
    """A generate() streamer that timestamps every new token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def no_eos_config(max_new_tokens: int, **options):
    """Greedy, no EOS and no stop criteria but length: the peer generates exactly what rackserve
    does. `options`: more GenerationConfig fields (e.g. its prompt lookup's)."""
    import transformers
    return transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                                         pad_token_id=0, **options)


def hf_stream_timing(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[float, float]:
    """One stream: (TTFT seconds, decode tokens/s after the first token)."""
    streamer = _TokenTimes()
    with torch.inference_mode():
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids])
        # An explicit mask, or generate() masks out prompt tokens equal to the pad id.
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=no_eos_config(max_new_tokens),
                       streamer=streamer)
    times = streamer.times
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0])


def hf_batched_generate_seconds(model, requests: list[tuple[list[int], int]], batch_size: int) -> float:
    """Run (prompt ids, output length) requests through generate() in static batches, left-padded,
    each batch generating its longest output; returns wall seconds."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(requests), batch_size):
            batch = requests[start:start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            out_len = max(o for _, o in batch)
            model.generate(ids, attention_mask=mask, generation_config=no_eos_config(out_len))
    return time.perf_counter() - t0
