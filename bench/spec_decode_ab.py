"""What n-gram speculative decoding (`--speculative-config`) gives SmolLM2 on this CPU, task by task.

Engines over SmolLM2-135M-Instruct's GGUF, one without drafts and one per --spec config, each run the
same chat tasks greedily (a copy of a text, a code edit, a question on a document, an open story:
from outputs that repeat their context to outputs that do not), one request at a time and then all
at once, in rounds whose engine order rotates (this VM's speed moves between minutes). Per task and
engine: decode tokens/s (output tokens over the time after the first token), its ratio to the engine
without drafts in the same round, the drafts' acceptance (kept / computed) and whether the greedy
tokens equal the engine without drafts'. With --peer hf, transformers' own prompt lookup
(`generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=N)` with the first --spec's K and N, the
same chat ids, its best dtype here) and its plain greedy decode run the single tasks in each round for
as many tokens as the engine without drafts gave: the engine's ratios to its peer. Writes them as JSON.

    python bench/spec_decode_ab.py --rounds 3 --peer hf --output bench/results/spec-decode-smollm2.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rackserve import LLM, SamplingParams  # noqa: E402
from rackserve.bench.record import machine_state  # noqa: E402
from rackserve.core.spec_decode import NgramProposer  # noqa: E402
from rackserve.engine.stats import SpecDecodeCounts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
                 '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}']


def tasks() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("rackserve"):][:900]
    code = inspect.getsource(NgramProposer.propose)
    return {
        "copy": f"Copy the following text exactly, word for word, and write nothing else:\n\n{paragraph}",
        "edit": "Rename the variable `best_len` to `longest` in this Python method and return the whole "
                f"method, otherwise unchanged:\n\n```python\n{code}```",
        "question": f"{paragraph}\n\nIn two sentences: what is rackserve, according to this text?",
        "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }


def timed(llm: LLM, counts: SpecDecodeCounts, prompts: dict[str, str], max_tokens: int) -> dict[str, dict]:
    """Each task alone, then all at once ("together"): tokens, decode seconds, drafts computed and kept."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = {}
    for name, text in [*((n, [t]) for n, t in prompts.items()), ("together", list(prompts.values()))]:
        d0, a0 = counts.num_draft_tokens, counts.num_accepted_tokens
        start = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": t}] for t in text], params)
        seconds = time.perf_counter() - start
        ids = [o.outputs[0].token_ids for o in outs]
        ttft = max(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
        out[name] = {"tokens": sum(map(len, ids)), "seconds": seconds, "decode_seconds": seconds - ttft,
                     "draft_tokens": counts.num_draft_tokens - d0, "accepted_tokens": counts.num_accepted_tokens - a0,
                     "token_ids": ids}
    return out


def rate(runs: list[dict]) -> float:
    """Decode tokens/s of timed runs together."""
    return sum(r["tokens"] for r in runs) / sum(r["decode_seconds"] for r in runs)


def hf_timed(model, ids: list[int], tokens: int, lookup: tuple[int, int] | None) -> float:
    """transformers' decode tokens/s over `tokens` greedy tokens (no EOS) after `ids`: the whole
    generate's time less a one-token generate's (its prefill and first token)."""
    import torch

    from rackserve.bench.hf_peer import no_eos_config

    def seconds(n: int) -> float:
        config = no_eos_config(n, **({} if lookup is None else {"prompt_lookup_num_tokens": lookup[0],
                                                                "max_matching_ngram_size": lookup[1]}))
        x = torch.tensor([ids])
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            return time.perf_counter() - start
    return (tokens - 1) / (seconds(tokens) - seconds(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", action="append", help="a --speculative-config to compare (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--peer", choices=["hf"], help="time transformers' prompt lookup on the single tasks too")
    parser.add_argument("--output")
    args = parser.parse_args()
    specs = args.spec or DEFAULT_SPECS
    load_before = machine_state()["load_average"]
    names = ["none", *specs]
    engines = {}
    for name in names:
        llm = LLM(model="smollm2-135m-instruct", kv_cache_memory=0.5, max_model_len=4096,
                  speculative_config=None if name == "none" else json.loads(name))
        counts = SpecDecodeCounts()
        llm.engine.stat_loggers.append(counts)
        timed(llm, counts, {"warmup": "Say hello."}, 16)
        engines[name] = (llm, counts)
    prompts = tasks()
    peer = None
    if args.peer:
        from rackserve.bench.hf_peer import best_cpu_dtype, load_hf_model
        peer, peer_dtype = load_hf_model("smollm2-135m-instruct"), str(best_cpu_dtype()).removeprefix("torch.")
        tokenizer = engines["none"][0].get_tokenizer()
        peer_ids = {t: tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
                    for t, text in prompts.items()}
        spec = json.loads(specs[0])
        lookup = (spec["num_speculative_tokens"], spec.get("prompt_lookup_max") or 5)
        hf_timed(peer, peer_ids["story"], 8, None)     # warm-up
    rounds, peer_rounds = [], []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        rounds.append({name: timed(*engines[name], prompts, args.max_tokens) for name in order})
        if peer is not None:
            peer_rounds.append({t: {side: hf_timed(peer, peer_ids[t], rounds[-1]["none"][t]["tokens"], how)
                                    for side, how in (("plain", None), ("lookup", lookup))} for t in prompts})
        print(f"round {r + 1}: " + ", ".join(
            f"{name[:40]} {rate(list(res.values())):.1f} tok/s"
            for name, res in rounds[-1].items()), flush=True)
    rows = []
    for task in [*prompts, "together"]:
        for name in names:
            runs = [rd[name][task] for rd in rounds]
            rates = [rate([x]) for x in runs]
            ratios = [rate([x]) / rate([rd["none"][task]]) for x, rd in zip(runs, rounds)]
            drafts, kept = sum(x["draft_tokens"] for x in runs), sum(x["accepted_tokens"] for x in runs)
            rows.append({"task": task, "speculative_config": None if name == "none" else json.loads(name),
                         "tokens": runs[0]["tokens"], "decode_tok_s": rates,
                         "median_decode_tok_s": statistics.median(rates),
                         "ratio_to_none": ratios, "median_ratio_to_none": statistics.median(ratios),
                         "acceptance": kept / drafts if drafts else None, "draft_tokens": drafts,
                         "accepted_tokens": kept,
                         "greedy_tokens_equal_none": all(x["token_ids"] == rd["none"][task]["token_ids"]
                                                         for x, rd in zip(runs, rounds))})
            r = rows[-1]
            print(f"{task:9s} {name[:60]:60s} {r['median_decode_tok_s']:7.1f} tok/s x{r['median_ratio_to_none']:.2f} "
                  f"acceptance {r['acceptance'] if r['acceptance'] is None else round(r['acceptance'], 3)} "
                  f"same tokens {r['greedy_tokens_equal_none']}")
            if peer_rounds and task in prompts:
                hf = [pr[task]["lookup" if name != "none" else "plain"] for pr in peer_rounds]
                r["hf_decode_tok_s"] = hf
                r["median_ratio_to_hf"] = statistics.median(a / b for a, b in zip(rates, hf))
                print(f"{'':9s}   transformers {'prompt lookup' if name != 'none' else 'greedy'} ({peer_dtype}): "
                      f"{statistics.median(hf):.1f} tok/s; rackserve x{r['median_ratio_to_hf']:.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "bench": "spec_decode_ab",
                       "model": "smollm2-135m-instruct",
                       "max_tokens": args.max_tokens, "load_average_before": load_before, **machine_state(),
                       "peer": None if peer is None else {"name": "transformers", "dtype": peer_dtype,
                                                          "prompt_lookup": {"prompt_lookup_num_tokens": lookup[0],
                                                                            "max_matching_ngram_size": lookup[1]}},
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
