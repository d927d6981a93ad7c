"""Penalties from rows kept across steps (model/penalties.py) against HF's
RepetitionPenaltyLogitsProcessor and vLLM's formulas over the whole token lists: a row built once
and updated with each sampled token moves logits exactly as the lists would, in any batch, and a
request resumed after preemption (its row rebuilt from prompt and outputs) samples what it would
have sampled without it, alone or as one of n."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from rackserve import LLM, SamplingParams
from rackserve.model.penalties import PenaltyRows
from tests.test_engine_parity import SETTINGS, prompts_for
from tests.tiny_models import TINY_KV_CACHE_GIB

CPU = torch.device("cpu")


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    pool = PenaltyRows(CPU)
    row = pool.add([0, 1], [1, 2], 5)
    out = pool.apply(logits, [0], [row], [SamplingParams(repetition_penalty=2.0)])
    # Tokens 0, 1, 2 were seen (prompt or output); 3 and 4 were not.
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 0.25, 3.0, -2.0]]))


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    pool = PenaltyRows(CPU)
    row = pool.add([3, 3], [0, 0, 0, 1], 4)
    out = pool.apply(logits, [0], [row], [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)])
    # token 0: 1 - 3 * 0.25 - 0.5 = -0.25; token 1: 1 - 0.25 - 0.5 = 0.25; 2 and 3 untouched.
    assert torch.allclose(out, torch.tensor([[-0.25, 0.25, 1.0, 1.0]]))


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row by the definitions: HF's processor over prompt + output, then vLLM's frequency and
    presence over the output's counts."""
    row = logits.unsqueeze(0)
    if p.repetition_penalty != 1.0:
        hf = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        row = hf(torch.tensor([prompt + output]), row.clone())
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
    return (row[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float())


def random_case(rng: random.Random, vocab: int) -> tuple[list[int], list[int], SamplingParams]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
    output = [rng.choice(prompt) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(rng.randrange(100))]
    kinds = rng.choice([{}, {"repetition_penalty": rng.uniform(0.5, 2.0)},
                        {"presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2)},
                        {"repetition_penalty": rng.uniform(0.5, 2.0), "frequency_penalty": rng.uniform(-2, 2)},
                        {"repetition_penalty": 1.3, "presence_penalty": 0.7, "frequency_penalty": 0.4}])
    return prompt, output, SamplingParams(**kinds)


@pytest.mark.parametrize("seed", range(3))
def test_rows_kept_across_steps_match_the_definitions_on_random_batches(seed):
    """Each row is built from its prompt and a part of its output, the rest appended a token a step
    (as the runner does; past 64 new tokens a row's ids are merged), in a pool that grows, frees and
    reuses rows, two rows sharing a prompt; every step's penalised logits equal the definitions
    over the whole lists (bit for bit where only HF's repetition applies)."""
    rng, vocab = random.Random(seed), 1000
    pool = PenaltyRows(CPU)
    stale = [pool.add([rng.randrange(vocab) for _ in range(50)], [1, 2, 3], vocab) for _ in range(5)]
    for row in stale[:3]:       # freed rows are reused and must not keep their old tokens
        pool.free(row)
    cases = [random_case(rng, vocab) for _ in range(10)]
    # One row certain to grow its ids past a merge: 100 distinct outputs, most of them new.
    cases[0] = (cases[0][0], rng.sample(range(vocab), 100),
                SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5))
    # Two samples of one request: one prompt, outputs of their own (the second reuses the first's ids).
    cases[2] = (cases[1][0], cases[2][1], SamplingParams(repetition_penalty=0.8, presence_penalty=1.0))
    penalised = [i for i, (_, _, p) in enumerate(cases) if p.repetition_penalty != 1.0
                 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    split = {i: rng.randrange(len(cases[i][1]) + 1) for i in penalised}
    rows = {i: pool.add(cases[i][0], cases[i][1][:split[i]], vocab) for i in penalised}
    for step in range(max(len(c[1]) for c in cases) + 1):
        logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(step)) * 4
        due = [i for i in penalised if split[i] + step <= len(cases[i][1])]
        if due:
            out = pool.apply(logits, due, [rows[i] for i in due], [cases[i][2] for i in due])
            for i in range(len(cases)):
                prompt, output, p = cases[i]
                if i not in due:
                    assert torch.equal(out[i], logits[i]), "a row without penalties is left alone"
                    continue
                want = reference(logits[i], prompt, output[:split[i] + step], p)
                if p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
                    assert torch.equal(out[i], want), (seed, i, step)
                else:
                    assert torch.allclose(out[i], want, rtol=1e-6, atol=1e-5), (seed, i, step)
        grow = [i for i in due if split[i] + step < len(cases[i][1])]
        pool.append([rows[i] for i in grow], [cases[i][1][split[i] + step] for i in grow])
    for row in [*rows.values(), *stale[3:]]:
        pool.free(row)
    assert pool.capacity == 0, "the pool is released when its last row is freed"


def test_a_token_outside_the_vocabulary_is_refused_by_name():
    pool = PenaltyRows(CPU)
    with pytest.raises(ValueError, match="token ids must be in"):
        pool.add([1, 70], [], 64)
    with pytest.raises(ValueError, match="token ids must be in"):
        pool.add([1], [-1], 64)
    assert pool.in_use == 0


def hf_greedy_penalised(model_dir: str, prompts: list[list[int]], p: SamplingParams) -> list[list[int]]:
    """Greedy over transformers' forward, with `reference` applied to each step's logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            tokens: list[int] = []
            out = model(torch.tensor([prompt]), use_cache=True)
            for _ in range(p.max_tokens):
                tokens.append(int(reference(out.logits[0, -1], prompt, tokens, p).argmax()))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            results.append(tokens)
    return results


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8,
                        frequency_penalty=0.3, presence_penalty=0.2)


def test_greedy_penalties_match_transformers_through_preemption(tiny_llama_dir):
    prompts = prompts_for(256)
    expected = hf_greedy_penalised(tiny_llama_dir, prompts, GREEDY)
    preemptions = []

    class Count:
        def record(self, sched_stats, iter_stats):
            preemptions.append(sched_stats.num_preemptions)

    with LLM(tiny_llama_dir, dtype="float32", device="cpu", **SETTINGS["preempt"]) as llm:
        llm.engine.stat_loggers.append(Count())
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        llm.engine.core.scheduler.check_integrity()
        # The workers hear of finished requests with the next step: any step frees their rows.
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
        assert llm.engine.core.executor.runner.penalties.capacity == 0, "finished requests free their rows"
    assert sum(preemptions) > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_seeded_penalised_samples_are_unchanged_by_preemption_batching_and_n(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in prompts_for(256)]
    params = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5 * (i % 3), frequency_penalty=0.8) for i in range(len(prompts))]
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB) as llm:
        alone = [[c.token_ids for c in llm.generate(p, sp)[0].outputs] for p, sp in zip(prompts, params)]
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", **SETTINGS["preempt"]) as llm:
        together = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        llm.engine.core.scheduler.check_integrity()
    assert together == alone
    assert all(a != b for a, b in alone), "the n samples draw apart"
