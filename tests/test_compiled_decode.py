"""torch.compile of the decode path (model/compiled_layers.py): compiled and eager steps give the same
greedy tokens, compiled graphs are really used, and --compilation-config / --enforce-eager parse
as vLLM's do. One small config only: inductor compiles slowly on 2 cores.
"""
from __future__ import annotations

import pytest

from rackserve.config import CompilationConfig
from rackserve.engine.llm import LLM
from rackserve.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 7]}, {"prompt_token_ids": [300, 12, 64]}]
# Different lengths: once the first request ends, steps of 1 token run padded to the size-2 graphs.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]


def _greedy(model_dir: str, **options) -> tuple[list[list[int]], object]:
    with LLM(model_dir, device="cpu", num_gpu_blocks_override=64, block_size=4, max_model_len=128, skip_tokenizer_init=True,
             **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        runner = llm.engine.core.executor.runner
        return [o.outputs[0].token_ids for o in outs], runner.compiled


def test_compiled_decode_gives_eager_greedy_tokens(tiny_llama_dir):
    eager, none = _greedy(tiny_llama_dir, enforce_eager=True)
    assert none is None
    compiled, decoder = _greedy(tiny_llama_dir, compilation_config='{"mode": 3, "compile_sizes": [2], '
                                                                   '"warmup": "startup"}')
    assert decoder is not None and decoder.ready == {2}, "the size-2 graphs must have compiled"
    assert decoder.steps == 11, "every decode step (2 tokens, then 1 padded to 2) ran compiled"
    assert compiled == eager
    # Each size and piece has a code object of its own, so dynamo never pools their graphs.
    codes = {fn._torchdynamo_orig_callable.__code__ for fns in decoder._fns.values() for fn in fns}
    assert len(codes) == 3 * len(decoder.sizes)
    assert [len(t) for t in compiled] == [12, 5]


def test_compilation_config_parsing():
    assert CompilationConfig.from_json(None).mode == 0
    assert CompilationConfig.from_json("3").mode == 3
    config = CompilationConfig.from_json('{"mode": 3, "compile_sizes": [1, 4]}')
    assert config.compile_sizes == (1, 4) and config.warmup == "background"
    assert CompilationConfig.from_json('{"mode": 3}', enforce_eager=True).mode == 0
    for bad in ('{"mode": 2}', '{"level": 3}', '{"mode": 3, "warmup": "later"}', '{"mode": 3, "compile_sizes": [0]}'):
        with pytest.raises(ValueError):
            CompilationConfig.from_json(bad)
