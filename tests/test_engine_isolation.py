"""A failure of one request ends that request alone: the engine, its KV cache and every other
request in the same batch go on as if it had never been there. Driven through the real engine
(tiny random Llama) with a request whose sampling raises, as a bug past validation would."""
from __future__ import annotations

from rackserve import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)


def test_a_request_whose_sampling_fails_ends_alone(tiny_llama_dir):
    # float32: the good requests' tokens are compared across two batchings, which in bf16 (auto on a
    # native-bf16 CPU: decode-only steps native in float32, mixed ones in bf16) can flip a near-tie.
    with LLM(tiny_llama_dir, device="cpu", dtype="float32", num_gpu_blocks_override=64) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())]
        engine = llm.engine
        bad = greedy(logit_bias={3: 1.0})
        engine.add_request("bad", {"prompt_token_ids": [5, 4, 3, 2]}, bad)
        bad.logit_bias = {10**6: 1.0}   # past validation: indexing the logits with it raises
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"good-{i}", {"prompt_token_ids": prompt}, greedy())
        tokens: dict[str, list[int]] = {}
        finish: dict[str, str] = {}
        reasons: dict[str, str | None] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
                if out.finished:
                    finish[out.request_id] = out.outputs[0].finish_reason
                    reasons[out.request_id] = out.outputs[0].stop_reason
        assert finish.pop("bad") == "error" and tokens.pop("bad") == []
        assert [tokens[f"good-{i}"] for i in range(len(PROMPTS))] == alone
        assert set(finish.values()) == {"length"}
        assert "sampling failed" in reasons["bad"]   # the reason travels with the error
        engine.core.check_integrity()
        # The engine takes new work as before.
        again = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy())
        assert again[0].outputs[0].token_ids == alone[0]


def test_logit_bias_steers_greedy_decoding(tiny_llama_dir):
    with LLM(tiny_llama_dir, device="cpu", num_gpu_blocks_override=64) as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(logit_bias={42: 100.0}))
        assert out[0].outputs[0].token_ids == [42] * 12
        llm.engine.core.check_integrity()
