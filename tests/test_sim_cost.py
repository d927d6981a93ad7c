"""The simulator's cost model: parameter, FLOP and byte counts against hand counts and against
bench forward's count of the real (meta-device) model; monotonic in batch and context; TP/EP
communication that vanishes at size 1; DP lockstep."""
from __future__ import annotations

import pytest

from rackserve.config import ModelConfig
from rackserve.sim.cost import CostModel, ParallelShape, SeqWork, StepCost
from rackserve.sim.hardware import HARDWARE, load_hardware
from rackserve.sim.model_spec import load_model_spec, model_aliases

GB300 = HARDWARE["GB300"]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir", "tiny_deepseek_v3_dir"])
def test_counts_match_bench_forwards_count_of_the_real_model(request, fixture):
    from rackserve.bench.forward_steps import model_cost
    path = request.getfixturevalue(fixture)
    real = model_cost(ModelConfig(path, path, path, "float32", "cpu", None, 0))
    spec = load_model_spec(path)
    router = spec.num_moe_layers * spec.hidden_size * spec.num_experts   # a gate, not a Linear, in the model
    assert spec.dense_params_per_token - router == real.linear_params
    assert spec.num_moe_layers * spec.num_experts * spec.expert_params == real.expert_params
    assert (spec.num_experts, spec.experts_per_token) == (real.num_experts, real.experts_per_token)
    assert spec.lm_head_params == real.lm_head_params
    assert spec.with_precision(kv="fp32").kv_bytes_per_token() == real.kv_bytes_per_token


def test_deepseek_v4_counts_match_bench_forwards_count_of_the_real_model(tmp_path):
    """Sliding, CSA and HCA layers with their compressors and indexer, grouped output projection,
    hash-routed and learned-routed experts: the linears the real model holds, counted from config.json."""
    from rackserve.bench.forward_steps import model_cost
    from tests.tiny_models import build_tiny_deepseek_v4
    path = build_tiny_deepseek_v4(tmp_path)
    real = model_cost(ModelConfig(path, path, path, "float32", "cpu", None, 0))
    spec = load_model_spec(path)
    router = spec.num_moe_layers * spec.hidden_size * spec.num_experts
    assert spec.dense_params_per_token - router == real.linear_params
    assert spec.num_moe_layers * spec.num_experts * spec.expert_params == real.expert_params
    assert [(k.count, k.compress) for k in spec.attention] == [(2, 4), (1, 16), (1, 0)]


def test_dense_step_flops_and_bytes_by_hand():
    """SmolLM2-135M: 30 layers of q, o (576x576), k, v (576x192), gate/up/down (576x1536), tied head."""
    spec = load_model_spec("smollm2-135m-instruct")
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert spec.dense_params_per_token == 30 * per_layer == 106_168_320
    assert spec.lm_head_params == 576 * 49152
    model = CostModel(spec, GB300)
    # Two decodes after 100 cached tokens: each query sees 101 keys; bf16 weights read once.
    dense, attn = model._dense([SeqWork(1, 100)] * 2), model._attention([SeqWork(1, 100)] * 2)
    assert dense.flops == 2 * 2 * (106_168_320 + 576 * 49152)
    assert dense.bytes == 2 * (106_168_320 + 576 * 49152)
    kv_token = 30 * 2 * 3 * 64 * 2       # K and V, 3 KV heads of 64, bf16
    assert attn.flops == 2 * 101 * 30 * 4 * 9 * 64
    assert attn.bytes == 2 * 101 * kv_token + 2 * kv_token   # read the context, write the new token


def test_moe_mla_counts_by_hand():
    """DeepSeek-V3: 671B parameters with the embedding (0.93B), 8 of 256 experts of 3 x 7168 x 2048
    in 58 MoE layers; MLA caches 512 + 64 values per token per layer."""
    spec = load_model_spec("deepseek-v3")
    assert spec.expert_params == 3 * 7168 * 2048 and spec.num_moe_layers == 58
    assert abs(spec.total_params + 7168 * 129280 - 671e9) / 671e9 < 0.005
    assert spec.kv_bytes_per_token() == 61 * 576 * 2
    model = CostModel(spec, GB300)
    # One token: k experts of every MoE layer, each read whole (fp8) and multiplied once.
    moe = model._moe(model._expert_loads(1), slice(None), 1)
    assert moe.flops == 2 * 8 * spec.expert_params * 58
    assert moe.bytes == 8 * spec.expert_params * 58 * 1.0
    # Absorbed MLA decode after 100 tokens: each of 128 heads scores the 576-wide latent of 101 keys
    # and sums 512 of it; the latent (bf16) is read once and one entry written, in 61 layers.
    attn = model._attention([SeqWork(1, 100)])
    assert attn.flops == 61 * 101 * (2 * 128 * 576 + 2 * 128 * 512)
    assert attn.bytes == 61 * 576 * 2 * (101 + 1)


@pytest.mark.parametrize("alias", model_aliases())
def test_step_time_grows_with_batch_and_context(alias):
    spec = load_model_spec(alias)

    def step(batch: list[SeqWork]) -> float:
        # A fresh model per point: equal token counts draw the same expert loads.
        return CostModel(spec, GB300, ParallelShape(8, 1, True), seed=0).step([batch]).seconds

    last = 0.0
    for batch in (1, 8, 64, 256):
        t = step([SeqWork(1, 4096)] * batch)
        assert t >= last
        last = t
    last = 0.0
    for context in (0, 1024, 16384, 131072):
        t = step([SeqWork(1, context)] * 32)
        assert t >= last
        last = t


def test_communication_vanishes_at_size_one_and_not_above():
    spec = load_model_spec("qwen3-30b-a3b")
    batch = [SeqWork(1, 1000)] * 16
    one = CostModel(spec, GB300, ParallelShape(1, 1, True)).step([batch])
    assert one.ranks[0].comm_seconds == 0.0
    tp2 = CostModel(spec, GB300, ParallelShape(2, 1, False)).step([batch])
    assert tp2.ranks[0].comm_seconds > 0.0
    ep2 = CostModel(spec, GB300, ParallelShape(1, 2, True)).step([batch, batch])
    assert all(r.comm_seconds > 0.0 for r in ep2.ranks)
    # Tensor parallelism halves each device's dense work.
    assert tp2.ranks[0].dense.flops == pytest.approx(one.ranks[0].dense.flops / 2)


def test_dp_ranks_step_in_lockstep_at_the_slowest_ranks_pace():
    spec = load_model_spec("deepseek-v4-flash")
    model = CostModel(spec, GB300, ParallelShape(1, 2, True))
    busy, idle = [SeqWork(1, 8192)] * 64, [SeqWork(1, 8192)] * 4
    step = model.step([busy, idle])
    assert step.ranks[0].busy_seconds > step.ranks[1].busy_seconds
    assert step.seconds >= max(r.busy_seconds for r in step.ranks)


def test_skewed_gate_loads_the_busiest_expert_rank_more():
    spec = load_model_spec("deepseek-v4-flash")
    batch = [SeqWork(1, 8192)] * 256
    uniform = CostModel(spec, GB300, ParallelShape(1, 8, True, 0.0), seed=1).step([batch] * 8)
    skewed = CostModel(spec, GB300, ParallelShape(1, 8, True, 1.2), seed=1).step([batch] * 8)
    assert max(r.moe.flops for r in skewed.ranks) > max(r.moe.flops for r in uniform.ranks)


def test_every_device_and_the_cpu_calibration_load():
    for name in (*HARDWARE, "cpu"):
        hw = load_hardware(name)
        assert hw.mem_bw > 0 and hw.peak_flops("bf16") > 0
    assert HARDWARE["GB300"].peak_flops("fp4") > HARDWARE["GB300"].peak_flops("fp8")
    assert HARDWARE["H100"].peak_flops("fp4") == HARDWARE["H100"].peak_flops("fp8")   # no FP4 units
    with pytest.raises(ValueError, match="neither a known device"):
        load_hardware("TPU-v9")


def test_precision_overrides_scale_weights_and_kv():
    spec = load_model_spec("llama-3-8b")
    fp8 = spec.with_precision("fp8", "fp8")
    assert fp8.kv_bytes_per_token() == spec.kv_bytes_per_token() / 2
    model, model8 = CostModel(spec, GB300), CostModel(fp8, GB300)
    assert model8._dense([SeqWork(1, 10)]).bytes == model._dense([SeqWork(1, 10)]).bytes / 2
    with pytest.raises(ValueError, match="unknown precision"):
        spec.with_precision("int3")


def test_cpu_calibration_recovers_step_times_it_was_fitted_to():
    """Points made by a known device: the fit reproduces each within 5%."""
    from rackserve.sim.calibrate import _cpu, fit
    spec = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    truth = _cpu(300e9, 25e9, {"gemm_flops": 0.6, "attn_flops": 0.4, "mem_bw": 0.9, "attn_mem_bw": 0.5},
                 (0.008, 0.002), "synthetic")
    model = CostModel(spec, truth)
    batches = [[SeqWork(1, c)] * b for b in (1, 8, 32) for c in (256, 2048)] + [[SeqWork(256, 0)] * b for b in (1, 4)]
    points = [(b, model.step([b]).seconds) for b in batches]
    fitted = CostModel(spec, fit(spec, points, 300e9, 25e9))
    for batch, seconds in points:
        assert fitted.step([batch]).seconds == pytest.approx(seconds, rel=0.05)


def test_a_packed_kernel_may_outrun_the_float32_matmul_peak_in_a_fit():
    """Integer dot products outrun float32 FMAs (the vnni kernel ran ~3x the float32 matmul on a
    Zen 5): a fit recovers a packed kernel's class above 1 and the prompt steps it prices, while the
    dense classes stay capped at the measured peak. Capped at 1 (before), the fit left these prompt
    steps at 1.9-2.4x their time."""
    import dataclasses

    from rackserve.sim.calibrate import _cpu, fit
    from rackserve.sim.cost import packed_class
    base = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    spec = dataclasses.replace(base, dense_weight_bytes=0.75, dequantize_above_tokens=10 ** 9, packed_kernel="vnni")
    eff = {"gemm_flops": 0.6, "attn_flops": 0.4, "mem_bw": 0.9, "attn_mem_bw": 0.5, packed_class("vnni"): 3.0}
    model = CostModel(spec, _cpu(300e9, 25e9, eff, (0.008, 0.002), "synthetic"))
    batches = [[SeqWork(1, c)] * b for b in (1, 8, 32) for c in (256, 2048)] + \
        [[SeqWork(n, 0)] * b for n in (128, 512) for b in (1, 4)]
    points = [(b, model.step([b]).seconds) for b in batches]
    fitted = fit(spec, points, 300e9, 25e9)
    assert fitted.efficiency[packed_class("vnni")] > 2
    assert all(v <= 1 for k, v in fitted.efficiency.items() if k != packed_class("vnni"))
    for batch, seconds in points:
        assert CostModel(spec, fitted).step([batch]).seconds == pytest.approx(seconds, rel=0.05)


def test_a_prompt_chunks_attention_over_its_cached_prefix_runs_at_its_own_rate():
    """prefix_attn_flops prices a chunk's queries against its cached context only (by hand: new x
    context x the per-key FLOPs of every layer, at that class's rate instead of attn_flops');
    a chunk without a context, decodes, and a calibration without the class are unchanged; the fit
    recovers the class from chunks after a context."""
    import dataclasses

    from rackserve.sim.calibrate import _cpu, fit
    spec = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    eff = {"gemm_flops": 0.6, "attn_flops": 0.4, "mem_bw": 0.9, "attn_mem_bw": 0.5}
    plain = _cpu(300e9, 25e9, eff, (0.008, 0.002), "synthetic")
    slow = dataclasses.replace(plain, efficiency={**eff, "prefix_attn_flops": 0.1})
    a, b = CostModel(spec, plain), CostModel(spec, slow)
    new, context = 64, 4096
    cached_flops = new * context * spec.attn_flops_per_key * spec.num_layers
    extra = cached_flops / 300e9 * (1 / 0.1 - 1 / 0.4)
    assert b.step([[SeqWork(new, context)]]).seconds - a.step([[SeqWork(new, context)]]).seconds == \
        pytest.approx(extra, rel=1e-9)
    for batch in ([SeqWork(new, 0)], [SeqWork(1, context)] * 4):
        assert b.step([batch]).seconds == a.step([batch]).seconds
    points = [(batch, b.step([batch]).seconds) for batch in
              [[SeqWork(1, c)] * n for n in (1, 8) for c in (256, 2048)]
              + [[SeqWork(n, c)] for n in (32, 256) for c in (0, 1024, 4096)]]
    fitted = fit(spec, points, 300e9, 25e9)
    assert fitted.efficiency["prefix_attn_flops"] < fitted.efficiency["attn_flops"]
    for batch, seconds in points:
        assert CostModel(spec, fitted).step([batch]).seconds == pytest.approx(seconds, rel=0.05)


def test_serving_path_costs_a_step_and_each_streamed_sequence():
    """The serving path's term prices sequences that stream a token, not prompt chunks that do not."""
    import dataclasses
    spec = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    cpu = load_hardware("cpu")
    served = dataclasses.replace(cpu, serve_step_overhead=0.004, serve_seq_overhead=0.003)
    decode, chunk = [SeqWork(1, 500)] * 4, [SeqWork(256, 0, samples=False)]
    for batch, streamed in ((decode, 4), (chunk, 0), (decode + chunk, 4)):
        extra = CostModel(spec, served).step([batch]).seconds - CostModel(spec, cpu).step([batch]).seconds
        assert extra == pytest.approx(0.004 + 0.003 * streamed)


def test_serving_path_is_measured_from_a_random_workload_run():
    """The median gap between streamed chunks at concurrency c = d x the model's decode step for c
    sequences + a (a few long gaps, other requests' prompt chunks, do not move it), and the TTFT of
    one request at a time = the front path + slowdown x its prompt's chunks + a a chunk: the fit finds
    the decode slowdown d, the prefill slowdown apart from it, and a; the cost model then prices a
    step of decodes with d and a step with a prompt chunk with the other; an agentx run (think times:
    the batch is unknown) is refused."""
    import dataclasses

    from rackserve.sim.serve_path import measure_serve_path
    spec = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    cpu = load_hardware("cpu")
    model = CostModel(spec, cpu)
    prefill = model.step([[SeqWork(512, 0, False)]]).seconds + model.step([[SeqWork(512, 512, True)]]).seconds
    front = (0.012, 3e-6)
    runs = []
    for c in (1, 2, 4, 8):
        step = 0.9 * model.step([[SeqWork(1, 1024 + 64)] * c]).seconds + 0.002
        gaps = [step] * 100 + [2.0] * 10    # ten steps stretched by prompt chunks
        chunks = [sum(gaps[:i]) for i in range(len(gaps) + 1)]
        requests = [{"kind": "main", "error": None, "start": 0.0, "prompt_tokens": 1024, "output_tokens": 128,
                     "chunk_times": chunks}] * 3
        ttft = front[0] + front[1] * 1024 + 1.3 * prefill + 2 * 0.002
        runs.append({"concurrency": c, "summary": {"itl": {"p50": 0.0}, "ttft": {"p50": ttft}}, "requests": requests})
    found = measure_serve_path({"workload": "random", "runs": runs}, spec, cpu, front)
    assert found["slowdown"] == pytest.approx(1.3, rel=1e-3)
    assert found["decode_slowdown"] == pytest.approx(0.9, rel=1e-3)
    assert found["step_seconds"] == pytest.approx(0.002, abs=1e-5)
    served = dataclasses.replace(cpu, serve_slowdown=1.3, serve_decode_slowdown=0.9)
    decodes, mixed = [SeqWork(1, 500)] * 4, [SeqWork(1, 500)] * 3 + [SeqWork(64, 0, False)]
    assert CostModel(spec, served).step([decodes]).seconds == pytest.approx(0.9 * model.step([decodes]).seconds)
    assert CostModel(spec, served).step([mixed]).seconds == pytest.approx(1.3 * model.step([mixed]).seconds)
    with pytest.raises(ValueError, match="random workload"):
        measure_serve_path({"workload": "agentx", "runs": runs}, spec, cpu)


def test_a_served_steps_spread_is_measured_at_one_lane_and_drawn_per_simulated_step(tiny_llama_dir):
    """At one lane every chunk gap is one decode step: the spread is each gap over its request's
    median (one quantile per twentieth of them) and each request's median over the median request's,
    held as long as a request decoded; a simulated step's time is its cost times a draw of the first
    each step and of the second each period, each value about as often, the same draws on a rerun;
    a device without a spread prices the cost."""
    import dataclasses
    import statistics

    from rackserve.config import EngineArgs
    from rackserve.core.outputs import SchedulerOutput
    from rackserve.sim.executor import SimExecutor
    from rackserve.sim.serve_path import step_spread

    def request(gaps: list[float], kind: str = "main") -> dict:
        return {"kind": kind, "error": None, "chunk_times": [sum(gaps[:i]) for i in range(len(gaps) + 1)]}
    steady = [0.010] * 60 + [0.012] * 20 + [0.020] * 20      # a tenth of the steps twice the median
    run = {"concurrency": 1, "requests": [request(steady), request(steady), request([2 * g for g in steady]),
                                          request([0.001, 5.0], "warmup")]}
    spread = step_spread(run)
    assert spread["step"] == pytest.approx([1.0] * 12 + [1.2] * 4 + [2.0] * 4)
    assert spread["slow"] == pytest.approx([1.0, 1.0, 2.0])        # one request slowed whole
    assert spread["slow_seconds"] == pytest.approx(4 / 3 * sum(steady))
    with pytest.raises(ValueError, match="one lane"):
        step_spread({**run, "concurrency": 2})

    config = EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=64).create_engine_config()
    plain = dataclasses.replace(load_hardware("cpu"), serve_step_spread=(), serve_slow_spread=())

    class Fixed:   # a pricer whose every step costs 10 ms on `hw`
        def __init__(self, hw):
            self.hw = hw

        def step(self, batches):
            return StepCost(0.01, [])

    def draws(hw) -> list[float]:
        executor = SimExecutor(config, Fixed(hw), load_model_spec("smollm2-135m-instruct"))
        times = []
        for _ in range(2000):
            executor.execute_dp([SchedulerOutput([], [], {}, 0)])
            times.append(executor.last_step_seconds / 0.01)
        return times

    fast = dataclasses.replace(plain, serve_step_spread=tuple(spread["step"]))
    drawn = draws(fast)
    assert drawn == draws(fast)
    assert statistics.median(drawn) == pytest.approx(1.0) and sum(d == 2.0 for d in drawn) / 2000 == pytest.approx(0.2, abs=0.03)
    slow = draws(dataclasses.replace(plain, serve_slow_spread=(1.0, 3.0), serve_slow_seconds=0.1))
    # Half the periods slow: half the time stepped (slow steps are fewer a period, each 3x longer).
    assert set(slow) == {1.0, 3.0} and sum(d for d in slow if d == 3.0) / sum(slow) == pytest.approx(0.5, abs=0.15)
    changes = [i for i in range(1, 2000) if slow[i] != slow[i - 1]]
    assert changes and min(b - a for a, b in zip(changes, changes[1:])) >= 3   # held for 0.1 s of steps
    assert set(draws(plain)) == {1.0}


def test_a_bounded_indexer_stops_growing_with_context():
    """DeepSeek-V4.1-Flash's indexer scores at most 16K candidate entries (the seeds): beyond 64K
    tokens of context its work is flat, while its keys are still stored for every entry."""
    spec = load_model_spec("deepseek-v4.1-flash")
    csa = next(k for k in spec.attention if k.index_flops_per_entry)
    assert csa.index_entries(32768) == 8192 and csa.index_entries(1 << 20) == csa.index_entries(1 << 17) == 16384
    assert csa.index_stored(1 << 20) == (1 << 20) / 4
    unbounded = next(k for k in load_model_spec("deepseek-v4-flash").attention if k.index_flops_per_entry)
    assert unbounded.index_entries(1 << 20) == (1 << 20) / 4


def test_packed_weights_are_dequantized_above_the_engines_row_threshold():
    """A GGUF's packed linears are unpacked for steps of more rows than the engine's kernel's
    `dense_above_rows` (each kernel its own: int4 and vnni differ): the cost model adds that pass
    over the weights there, and only there, and below it prices the kernel's own efficiency class."""
    import dataclasses
    from rackserve.model.quant.quantized_linear import QUANT_KERNELS
    from rackserve.sim.cost import packed_class
    spec = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    cpu = load_hardware("cpu")
    for kernel in ("int4", "vnni"):
        rows = QUANT_KERNELS.get(kernel).dense_above_rows
        packed = dataclasses.replace(spec, dense_weight_bytes=0.75, dequantize_above_tokens=rows, packed_kernel=kernel)
        rated = dataclasses.replace(cpu, efficiency={**cpu.efficiency, packed_class(kernel): 0.1})
        for tokens, extra in ((rows, 0.0), (rows + 1, 2 * 4.0 * spec.dense_params_per_token)):
            batch = [SeqWork(tokens, 0)]
            assert (CostModel(packed, cpu)._dense(batch).bytes
                    == pytest.approx(CostModel(spec, cpu)._dense(batch).bytes * 0.75 / 4 + extra))
        # Below the threshold the kernel's own (here much lower) rate sets the compute time.
        at, above = [SeqWork(rows, 0)], [SeqWork(rows + 1, 0)]
        assert CostModel(packed, rated)._dense(at).seconds > 2 * CostModel(packed, cpu)._dense(at).seconds
        assert CostModel(packed, rated)._dense(above).seconds == CostModel(packed, cpu)._dense(above).seconds


def test_a_calibration_records_the_kernels_the_engine_ran(smollm2_gguf):
    """bench forward records the engine's own kernel choice (ModelConfig.quant_kernel resolved, the
    kernel class's dense_above_rows, whether the native decode attention runs) and the calibration
    takes its threshold and its decode padding from that record, never from a constant."""
    import dataclasses

    from rackserve.bench.engine_kernels import engine_kernels
    from rackserve.config import ModelConfig
    from rackserve.model.native import choose_isa
    from rackserve.model.quant.kernel_choice import choose_quant_kernel
    from rackserve.model.quant.quantized_linear import QUANT_KERNELS
    from rackserve.sim.calibrate import _as_measured, calibrated_spec, fit
    base = load_model_spec("smollm2-135m-instruct")
    for quant_kernel in ("auto", "int4"):
        model = ModelConfig(smollm2_gguf, "m", smollm2_gguf, "float32", "cpu", None, 0, quantization="gguf",
                            quant_kernel=quant_kernel)
        kernels = engine_kernels(model)
        name = choose_quant_kernel().name if quant_kernel == "auto" else "int4"
        assert kernels == {"quant_kernel": name, "dense_above_rows": QUANT_KERNELS.get(name).dense_above_rows,
                           "native_decode_attention": choose_isa().isa != "none"}   # avx2 on a Zen
        weight_bytes = 0.7 * (base.dense_params_per_token + base.lm_head_params)
        result = {"settings": {"A": {"dtype": "float32", "cost": {"weight_bytes": weight_bytes}, "kernels": kernels}}}
        spec = calibrated_spec(base, _as_measured(base, result))
        assert (spec.packed_kernel, spec.dequantize_above_tokens) == (name, kernels["dense_above_rows"])
        points = [([SeqWork(1, 300)] * 2, 0.03), ([SeqWork(64, 0)], 0.05)]
        assert fit(spec, points, 2e11, 2e10, pads_decodes=False).pads_decodes is False
    # The native kernel takes float32 or bfloat16 queries over a float32, float16 or bfloat16 cache;
    # a float16 model's decodes go to padded SDPA.
    native = choose_isa().isa != "none"
    assert engine_kernels(dataclasses.replace(model, dtype="float16"))["native_decode_attention"] is False
    assert engine_kernels(dataclasses.replace(model, dtype="bfloat16"))["native_decode_attention"] is native
    assert engine_kernels(model, "bfloat16")["native_decode_attention"] is native
    assert engine_kernels(model, "float16")["native_decode_attention"] is native
    with pytest.raises(ValueError, match="re-run bench forward"):
        _as_measured(base, {"settings": {"A": {"dtype": "float32", "cost": {"weight_bytes": 1.0}}}})


def test_a_backend_that_pads_decodes_prices_each_at_the_longest_context():
    """The CPU's torch attention gathers a step's decodes into one batch padded to the longest
    context (model/torch_attention.py): a short decode beside a long one costs as much attention as
    the long one; a lone decode and a GPU's paged kernels pay for their own context."""
    import dataclasses
    spec = load_model_spec("smollm2-135m-instruct")
    paged = load_hardware("cpu")
    padded = dataclasses.replace(paged, pads_decodes=True)
    mixed, long = [SeqWork(1, 200), SeqWork(1, 4000)], [SeqWork(1, 4000), SeqWork(1, 4000)]
    assert CostModel(spec, padded)._attention(mixed).bytes == CostModel(spec, padded)._attention(long).bytes
    assert CostModel(spec, paged)._attention(mixed).bytes < CostModel(spec, paged)._attention(long).bytes
    lone = [SeqWork(1, 200)]
    assert CostModel(spec, padded)._attention(lone).bytes == CostModel(spec, paged)._attention(lone).bytes
    prefill = [SeqWork(300, 0), SeqWork(1, 4000)]    # a prompt chunk is not padded to the decodes
    assert CostModel(spec, padded)._attention(prefill).bytes == CostModel(spec, paged)._attention(prefill).bytes


def test_the_native_decode_attentions_busiest_thread_sets_the_decodes_pace():
    """csrc/paged_decode_attention.cpp's split, by hand: under 1,024 keys (tokens x KV heads) one
    thread does it all; a long context is cut into parts of >= 256 tokens, about two per thread
    (768 and 128 in the avx2 build),
    handed out in contiguous runs (OpenMP static), so one long row beside a short one puts both of
    the long row's halves on the first thread. Prompt chunks are not split by it."""
    import dataclasses
    from rackserve.sim.cpu_attention import decode_attention_imbalance
    assert decode_attention_imbalance([257], kv_heads=3, threads=2) == 2.0          # 771 keys: one thread
    assert decode_attention_imbalance([2048], kv_heads=3, threads=2) == 1.0         # 4 parts of 512
    assert decode_attention_imbalance([3000, 200], kv_heads=3, threads=2) == 3000 * 2 / 3200
    assert decode_attention_imbalance([700, 300], kv_heads=3, threads=2) == 700 * 2 / 1000   # one part each
    assert decode_attention_imbalance([3000, 200], kv_heads=3, threads=1) == 1.0
    # The avx2 build splits sooner: from 768 keys, parts of >= 128 tokens.
    assert decode_attention_imbalance([200], kv_heads=3, threads=2, isa="avx2") == 2.0    # 600 keys
    assert decode_attention_imbalance([257], kv_heads=3, threads=2, isa="avx2") == 129 * 2 / 257   # 128 + 129
    spec = load_model_spec("smollm2-135m-instruct")
    even = dataclasses.replace(load_hardware("cpu"), pads_decodes=False, decode_attn_threads=0)
    split = dataclasses.replace(even, decode_attn_threads=2)
    mixed = [SeqWork(1, 2999), SeqWork(1, 199)]
    assert CostModel(spec, split)._attention(mixed).bytes > 1.8 * CostModel(spec, even)._attention(mixed).bytes
    balanced, prompt = [SeqWork(1, 2047), SeqWork(1, 2047)], [SeqWork(300, 0), SeqWork(200, 100)]
    assert CostModel(spec, split)._attention(balanced).bytes == CostModel(spec, even)._attention(balanced).bytes
    assert CostModel(spec, split)._attention(prompt).bytes == CostModel(spec, even)._attention(prompt).bytes


@pytest.mark.parametrize("world", [1, 5, 48, 300])   # 384 experts: 77 a device over 5, 2 over 300 (the last none)
def test_the_devices_moe_at_once_is_each_devices_own(world):
    """A wide-EP step prices every device's experts from one pass over the loads: the same
    OpCost, to the bit, as the device's slice priced alone."""
    model = CostModel(load_model_spec("deepseek-v4.1-flash"), GB300,
                      ParallelShape(data_parallel_size=world, enable_expert_parallel=True))
    loads = model._expert_loads(37 * world)
    per = -(-len(loads) // world)
    pairs, active = model._per_device(loads, world, per)
    for r in range(world):
        assert model._moe_of(pairs[r], active[r], 1) == model._moe(loads, slice(r * per, (r + 1) * per), 1)
