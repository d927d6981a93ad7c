"""AsyncEngine builds its LLMEngine on the engine thread (the one that steps it): a failure to
build reaches the caller, and a built engine generates what the offline LLM does."""
import asyncio
import os
import threading

import pytest

from rackserve.config import EngineArgs
from rackserve.engine.async_engine import PREPARE_NICENESS, AsyncEngine
from rackserve.engine.llm import LLM
from rackserve.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_model


def test_a_failed_build_raises_in_the_caller_and_leaves_no_engine_thread(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(Exception):
        AsyncEngine(EngineArgs(model=str(tmp_path / "missing"), device="cpu"))
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "rackserve-engine"]


def test_the_engine_thread_generates_what_the_offline_engine_does(tmp_path):
    path = build_tiny_model("LlamaForCausalLM", tmp_path / "m")
    args = EngineArgs(model=path, device="cpu", num_gpu_blocks_override=32, max_model_len=256, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 5, 9, 13, 17]}
    engine = AsyncEngine(args)
    try:
        async def run():
            tokens = []
            async for out in engine.generate(prompt, params, "r0"):
                tokens += out.outputs[0].token_ids
            return tokens
        served = asyncio.run(run())
    finally:
        engine.shutdown()
    offline = LLM(path, device="cpu", num_gpu_blocks_override=32, max_model_len=256, skip_tokenizer_init=True).generate(
        [prompt], params)[0].outputs[0].token_ids
    assert served == list(offline) and len(served) == 6


def test_shutdown_fails_requests_in_flight_at_once_not_after_the_step_in_progress(tmp_path):
    """Before: a request heard of the shutdown only once the engine thread finished its step; a
    step longer than the server's grace period (a prefill on a busy machine) left the handler to be
    cancelled by uvicorn, a bare 500 instead of the 503 of an engine that is shut down."""
    import time

    from rackserve.engine.llm_engine import EngineDeadError
    path = build_tiny_model("LlamaForCausalLM", tmp_path / "m")
    engine = AsyncEngine(EngineArgs(model=path, device="cpu", num_gpu_blocks_override=32, max_model_len=256,
                                    skip_tokenizer_init=True))
    step, in_step = engine.engine.step, threading.Event()

    def slow_step():   # the step in progress when the shutdown comes takes 4 s
        in_step.set()
        time.sleep(4)
        return step()
    engine.engine.step = slow_step

    async def run() -> float:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in engine.generate({"prompt_token_ids": [1, 5, 9]}, params, "r0"):
                pass
        return time.monotonic()

    async def main() -> tuple[float, float]:
        task = asyncio.create_task(run())
        await asyncio.to_thread(in_step.wait)
        asked = time.monotonic()
        stopping = asyncio.create_task(asyncio.to_thread(engine.shutdown))
        failed_at = await task
        await stopping
        return asked, failed_at
    asked, failed_at = asyncio.run(main())
    assert failed_at - asked < 2, f"the request failed {failed_at - asked:.1f} s after the shutdown"


def test_prompts_are_prepared_in_threads_of_lower_priority_than_the_engine(tmp_path):
    """A body of many long prompts keeps the tokenizer busy for seconds: its threads yield the CPU
    to the engine thread's steps (a running stream's longest gap fell 3-10x, bench/body_stall.py)."""
    path = build_tiny_model("LlamaForCausalLM", tmp_path / "m")
    engine = AsyncEngine(EngineArgs(model=path, device="cpu", num_gpu_blocks_override=32, max_model_len=256,
                                    skip_tokenizer_init=True))
    try:
        def niceness() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        engine_nice = niceness()   # the engine thread was started from this one: it keeps this value
        prepare_nice = engine._prepare_pool.submit(niceness).result()
        assert prepare_nice == min(19, engine_nice + PREPARE_NICENESS)

        async def run():
            return [out async for out in engine.generate({"prompt_token_ids": [1, 5]},
                                                         SamplingParams(max_tokens=2, ignore_eos=True), "r0")]
        assert asyncio.run(run())[-1].finished
    finally:
        engine.shutdown()
