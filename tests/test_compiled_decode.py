"""torch.compile of the decode path (model/compiled_layers.py): compiled and eager steps give the same
greedy tokens, compiled graphs are really used, and --compilation-config / --enforce-eager parse
as vLLM's do. One small config only: inductor compiles slowly on 2 cores.
"""
from __future__ import annotations

import pytest

from rackserve.config import CompilationConfig
from rackserve.engine.llm import LLM
from rackserve.engine.stats import SpecDecodeCounts
from rackserve.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 7]}, {"prompt_token_ids": [300, 12, 64]}]
# Different lengths: once the first request ends, steps of 1 token run padded to the size-2 graphs.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]


def _greedy(model_dir: str, prompts=PROMPTS, params=PARAMS, stats=None, **options) -> tuple[list, object]:
    with LLM(model_dir, device="cpu", num_gpu_blocks_override=64, block_size=4, max_model_len=128, skip_tokenizer_init=True,
             **options) as llm:
        if stats is not None:
            llm.engine.stat_loggers.append(stats)
        outs = llm.generate(prompts, params)
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


def test_compiled_decode_verifies_drafts_as_eager_does(tiny_llama_dir):
    """Speculative decoding's drafts run as decode rows through the compiled graphs (a step of a
    token and its drafts is padded to a compiled size like any other): the eager greedy tokens."""
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 7] * 4}, {"prompt_token_ids": [300, 12, 64] * 5}]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    eager, _ = _greedy(tiny_llama_dir, prompts, params, enforce_eager=True)
    stats = SpecDecodeCounts()
    drafted, decoder = _greedy(tiny_llama_dir, prompts, params, stats,
                               compilation_config='{"mode": 3, "compile_sizes": [8], "warmup": "startup"}',
                               speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                  '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    assert decoder.ready == {8} and decoder.steps > 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, "drafts must be computed and kept"
    assert drafted == eager


def test_compilation_config_parsing():
    assert CompilationConfig.from_json(None).mode == 0
    assert CompilationConfig.from_json("3").mode == 3
    config = CompilationConfig.from_json('{"mode": 3, "compile_sizes": [1, 4]}')
    assert config.compile_sizes == (1, 4) and config.warmup == "background"
    assert CompilationConfig.from_json('{"mode": 3}', enforce_eager=True).mode == 0
    for bad in ('{"mode": 2}', '{"level": 3}', '{"mode": 3, "warmup": "later"}', '{"mode": 3, "compile_sizes": [0]}'):
        with pytest.raises(ValueError):
            CompilationConfig.from_json(bad)
