"""GGUF weights kept quantized (--quantization gguf): Q4_0, Q4_1 and Q8_0 blocks decoded into int4
groups exactly as gguf-py dequantizes them, each quantized-linear kernel (torch's int4, our vnni and
avx2) against the fp32 matmul of the dequantized weight, the kernel choice from given CPU flags, and tiny
GGUF models loaded quantized against their HF originals.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rackserve.config import ModelConfig
from rackserve.model.loader import load_model
from rackserve.model.quant.avx2_linear import DEFAULT_MANY_ROWS, set_many_rows
from rackserve.model.quant.gguf_blocks import from_gguf
from rackserve.model.quant.int4_linear import DENSE_ABOVE_ROWS
from rackserve.model.native import ISAS, unavailable_reason
from rackserve.model.quant.kernel_choice import choose_quant_kernel
from rackserve.model.quant.quantized_linear import QUANT_KERNELS
from tests.test_model_gguf import write_gguf
from tests.test_model_parity import prefill_logits
from tests.tiny_models import load_hf

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]
# The native kernels wherever their build runs: both on an AVX-512 machine, so CI pins both.
KERNELS = ["int4"] + [pytest.param(kernel, marks=pytest.mark.skipif(why is not None, reason=str(why)))
                      for kernel, why in [("vnni", unavailable_reason(isa="avx512")),
                                          ("avx2", unavailable_reason(isa="avx2"))]]
# Largest error of an output, relative to its row's largest: torch's int4 kernel rounds activations
# and outputs to bf16 (~0.4%); the native kernels' two int8 parts of each activation leave ~1e-5. A
# wrong scale or zero of one group out of six shifts outputs by tens of percent.
TOLERANCE = {"int4": 2e-2, "vnni": 2e-4, "avx2": 2e-4}
ZEN = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}         # an AMD Zen 2/3: no avx512*


def random_blocks(qtype: str, rows: int = 72, cols: int = 192, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF blocks of a random weight (rows not a multiple of the kernel's 16), and their fp32 values
    as gguf-py dequantizes them. An offset makes Q4_1's minimum and the zeros matter."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) + 0.5
    blocks = quantize(w, Q[qtype])
    if qtype == "Q8_0":
        blocks[:, 2] = 0x80         # a code of -128, which a file may hold: the avx2 kernel's |q| edge
    return blocks, torch.from_numpy(dequantize(blocks, Q[qtype]).copy())


@pytest.mark.parametrize("qtype", QTYPES)
def test_int4_groups_decode_gguf_blocks_exactly(qtype):
    blocks, ref = random_blocks(qtype)
    groups = from_gguf(qtype, blocks)
    assert groups.shape == tuple(ref.shape)
    assert int(groups.codes.max()) < 16
    assert torch.equal(groups.dequantize(), ref)
    # Column slices at group boundaries (tensor parallelism) decode to the same columns.
    assert torch.equal(groups.narrow(1, 64, 96).dequantize(), ref[:, 64:160])
    with pytest.raises(ValueError, match="multiples of 32"):
        groups.narrow(1, 16, 32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", QTYPES)
# 12 and 45: the native kernels' blocks of 8 and 4 rows and a single row after them; 515: the
# native kernels' chunks of 64 rows with a tail.
@pytest.mark.parametrize("rows", [1, 7, 12, 45, DENSE_ABOVE_ROWS + 3, 515])
def test_kernel_matches_dequantized_fp32_matmul(kernel, qtype, rows):
    blocks, w = random_blocks(qtype)
    linear = QUANT_KERNELS.get(kernel)(from_gguf(qtype, blocks))
    # An outlier per row, as real activations have, and bf16 in and out.
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    x[:, rows % w.shape[1]] *= 20
    ref = x @ w.T
    for dtype in (torch.float32, torch.bfloat16):
        y = linear(x.to(dtype))
        assert y.dtype == dtype and y.shape == ref.shape
        err = (y.float() - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert float(err.max()) < (1e-5 if rows > linear.dense_above_rows and dtype == torch.float32
                                   else TOLERANCE[kernel] if dtype == torch.float32 else 2e-2)
    assert torch.equal(linear.dequantize(), w)


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_a_native_kernel_splits_a_wide_weight_over_threads_and_tile_groups(kernel):
    # 40 tiles of 48 blocks: on two threads each takes 20, in two of vnni's ~256 KB groups of tiles;
    # 29 rows: tile calls of 12, 12 and 4 rows, then one row alone.
    blocks, w = random_blocks("Q4_1", rows=640, cols=1536)
    linear = QUANT_KERNELS.get(kernel)(from_gguf("Q4_1", blocks))
    x = torch.randn(29, w.shape[1], generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 20
    ref = x @ w.T
    err = (linear(x) - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(err.max()) < TOLERANCE[kernel]


def rounded_activations(x: torch.Tensor, tau: float) -> tuple[torch.Tensor, float]:
    """x as the vnni kernel's --packed-activations sees it: per 32-value block q dx (q = x / dx
    rounded, dx = max|x| / 127), plus r dx / 256 (the residual rounded in those steps) where the
    block's max|x| exceeds tau times its row's RMS; and the share of blocks that kept r."""
    rows, k = x.shape
    b = x.reshape(rows, k // 32, 32)
    top = b.abs().amax(-1, keepdim=True)
    dx = top / 127
    q = torch.round(b / dx).clamp(-127, 127) * dx
    keep = top > tau * x.pow(2).mean(-1).sqrt()[:, None, None]
    r = torch.round((b - q) / (dx / 256)).clamp(-128, 127) * (dx / 256)
    return torch.where(keep, q + r, q).reshape(rows, k), float(keep.float().mean())


@pytest.mark.skipif(unavailable_reason(isa="avx512") is not None, reason=str(unavailable_reason(isa="avx512")))
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("mode", ["one-part", "adaptive"])
def test_fewer_activation_parts_multiply_exactly_what_they_round_to(qtype, mode):
    """--packed-activations: calls of 64+ rows give the fp32 product of the dequantized weight with
    x rounded as the mode says (within 1e-4 of a row's scale, ~1e-6 where one part is used: a wrong
    block scale, a residual kept or dropped in the wrong block, or Q4_1's minimum taken from the exact
    sum of x all show at 1e-3 and more), in 12-row tiles
    where no row, some rows or every row kept a residual; calls of fewer rows keep both parts."""
    from rackserve.model.quant.vnni_linear import ACTIVATION_PARTS
    blocks, w = random_blocks(qtype, rows=96, cols=576)
    linear = QUANT_KERNELS.get("vnni")(from_gguf(qtype, blocks))
    two_part = QUANT_KERNELS.get("vnni")(from_gguf(qtype, blocks))
    linear.use_activation_parts(mode)
    for rows in (64, 100, 515):   # 100: tiles of 12 rows, then 4; 515: then 8, 4 and single rows
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        x[::3, 7] *= 20           # a large activation in every third row: tiles of mixed rows
        x[1::5, 100:132] *= 6     # a block of large values: kept in adaptive, by some rows only
        want, kept = rounded_activations(x, ACTIVATION_PARTS[mode])
        assert (kept == 0.0) if mode == "one-part" else (0.005 < kept < 0.2), kept
        scale = (x @ w.T).abs().amax(-1)
        err = ((linear(x) - want @ w.T).abs().amax(-1) / scale).max()
        assert float(err) < 1e-4, (rows, float(err))
        # Against float32: one part leaves ~1e-2 of a row's scale, two parts ~1e-5.
        assert float(((linear(x) - x @ w.T).abs().amax(-1) / scale).max()) > 1e-3
    x = torch.randn(63, w.shape[1], generator=torch.Generator().manual_seed(63))
    assert torch.equal(linear(x), two_part(x))


def test_packed_activations_need_the_vnni_kernel(tmp_path, tiny_llama_dir):
    from rackserve.config import EngineArgs
    with pytest.raises(ValueError, match="needs the vnni kernel"):
        EngineArgs(model=tiny_llama_dir, device="cpu", packed_activations="adaptive").create_engine_config()
    blocks, _ = random_blocks("Q8_0")
    with pytest.raises(ValueError, match="only the vnni kernel"):
        QUANT_KERNELS.get("int4")(from_gguf("Q8_0", blocks)).use_activation_parts("one-part")


@pytest.mark.skipif(unavailable_reason(isa="avx2") is not None, reason=str(unavailable_reason(isa="avx2")))
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_avx2_few_rows_path_on_a_wide_weight_over_two_threads(qtype):
    # A decode batch's rows (fewer than 5: avx2's one-part int16 activations, row by row) on an
    # lm_head-like weight: 104 tiles of 48 blocks, split over 2 threads (6 tiles a thread at least).
    blocks, w = random_blocks(qtype, rows=832, cols=1536, seed=3)
    linear = QUANT_KERNELS.get("avx2")(from_gguf(qtype, blocks))
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1))
    x[:, 11] *= 20
    ref = (x.double() @ w.double().T).float()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    before = set_many_rows(DEFAULT_MANY_ROWS)   # 3 rows: the few-rows path
    try:
        y = linear(x)
        one = linear(x[2:])
        set_many_rows(1)                        # and the many-rows path on the same weight and threads
        many = linear(x)
    finally:
        torch.set_num_threads(threads)
        set_many_rows(before)
    for out in (y, many):
        err = (out - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert float(err.max()) < TOLERANCE["avx2"]
    assert torch.equal(one, y[2:])      # a row's outputs do not depend on the rows beside it
    # Q8_0's many rows meet the codes widened once a tile: tile_dot's integer sums, to the bit.
    assert torch.equal(many, y) == (qtype == "Q8_0")


@pytest.mark.skipif(unavailable_reason(isa="avx2") is not None, reason=str(unavailable_reason(isa="avx2")))
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_avx2_few_and_many_rows_paths_agree_at_every_crossover(qtype):
    # 1 to 8 rows through the few-rows path (crossover past them) and the many-rows one (crossover
    # 1), each against the fp32 product of the dequantized weight.
    blocks, w = random_blocks(qtype, rows=80, cols=576, seed=5)
    linear = QUANT_KERNELS.get("avx2")(from_gguf(qtype, blocks))
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(2))
    x[:, 3] *= 20
    ref = (x.double() @ w.double().T).float()
    before = set_many_rows(DEFAULT_MANY_ROWS)
    outputs = {}
    try:
        for crossover in (9, 1):
            set_many_rows(crossover)
            for rows in range(1, 9):
                y = outputs[crossover, rows] = linear(x[:rows])
                err = (y - ref[:rows]).abs().amax(-1) / ref[:rows].abs().amax(-1)
                assert float(err.max()) < TOLERANCE["avx2"], (crossover, rows)
    finally:
        set_many_rows(before)
    # The crossover picks a path: Q4_*'s round x differently (~1e-5 apart); Q8_0's two give the same sums.
    assert torch.equal(outputs[9, 4], outputs[1, 4]) == (qtype == "Q8_0")


@pytest.mark.skipif(unavailable_reason(isa="avx2") is not None, reason=str(unavailable_reason(isa="avx2")))
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
# 88, 80, 72 and 48 output rows: 11, 10, 9 and 6 tiles of 8, i.e. the avx2 many-rows call's 4 tiles
# at once and its tails of 3, 2 and 1; 21 rows: a chunk of 16 rows and one of 5.
@pytest.mark.parametrize("out_rows", [88, 80, 72, 48])
def test_the_avx2_many_rows_path_takes_every_tail_of_tiles_and_rows(qtype, out_rows):
    blocks, w = random_blocks(qtype, rows=out_rows, cols=576)
    linear = QUANT_KERNELS.get("avx2")(from_gguf(qtype, blocks))
    x = torch.randn(21, w.shape[1], generator=torch.Generator().manual_seed(out_rows))
    x[:, 7] *= 20
    ref = x @ w.T
    err = (linear(x) - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(err.max()) < TOLERANCE["avx2"]


def test_the_kernel_choice_follows_the_cpu_flags_and_the_build(tmp_path):
    from rackserve.model.native import build_library
    (tmp_path / "a-file").write_text("")
    xeon = set(ISAS["avx512"].cpu_flags) | ZEN
    unwritable = choose_quant_kernel(xeon, build=lambda isa: build_library(isa, str(tmp_path / "a-file" / "k")))
    assert unwritable.name == "int4" and "failed" in unwritable.reason

    def fails(isa):
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    assert choose_quant_kernel(xeon, build=lambda isa: "lib.so").name == "vnni"
    # vnni > avx2 > int4, by the flags: a Xeon without VNNI (Skylake) and a Zen take the avx2 build.
    for flags in (xeon - {"avx512_vnni"}, ZEN):
        avx2 = choose_quant_kernel(flags, build=lambda isa: "lib.so")
        assert avx2.name == "avx2" and "not avx512: the CPU lacks" in avx2.reason
    assert choose_quant_kernel(ZEN - {"f16c"}, build=lambda isa: "lib.so").name == "int4"
    # The avx2 build alone failing (say a source it cannot compile) leaves vnni where it runs.
    assert choose_quant_kernel(xeon, build=lambda isa: fails(isa) if isa == "avx2" else "lib.so").name == "vnni"
    unbuilt = choose_quant_kernel(ZEN, build=fails)
    assert unbuilt.name == "int4" and "no C++ compiler" in unbuilt.reason
    assert choose_quant_kernel(set()).name == "int4"          # /proc/cpuinfo unreadable: nothing assumed


def test_native_isa_flag_picks_the_build_and_the_auto_kernel():
    from rackserve.model.native import resolve_native_isa
    from rackserve.model.quant.kernel_choice import resolve_quant_kernel
    assert resolve_native_isa("avx2", "cpu").isa == "avx2"
    assert resolve_native_isa("auto", "cuda").isa == "none"
    assert [resolve_quant_kernel("auto", "gguf", "cpu", isa).name for isa in ("avx512", "avx2", "none")] \
        == ["vnni", "avx2", "int4"]
    assert resolve_quant_kernel("int4", "gguf", "cpu", "avx2").name == "int4"     # a given kernel is kept


@pytest.mark.parametrize("kernel", KERNELS)
def test_exact_top_recomputes_the_largest_outputs_in_fp32(kernel):
    blocks, w = random_blocks("Q8_0", rows=512, cols=64)
    linear = QUANT_KERNELS.get(kernel)(from_gguf("Q8_0", blocks))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 4
    ref = x @ w.T
    y = linear(x, exact_top=8)
    top = ref.topk(8, dim=-1).indices
    torch.testing.assert_close(y.gather(1, top), ref.gather(1, top), atol=1e-4, rtol=1e-4)
    assert torch.equal(y.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("fixture,qtype,native_isa", [
    ("tiny_llama_dir", "Q4_1", "auto"), ("tiny_llama3_rope_dir", "Q8_0", "auto"), ("tiny_qwen3_dir", "Q4_0", "auto"),
    # --native-isa avx2: its quantized kernel and fused ops end to end (an AVX-512 machine runs it too).
    pytest.param("tiny_llama_dir", "Q8_0", "avx2", marks=pytest.mark.skipif(
        unavailable_reason(isa="avx2") is not None, reason=str(unavailable_reason(isa="avx2"))))])
def test_tiny_gguf_kept_quantized_matches_its_hf_original(fixture, qtype, native_isa, request, tmp_path):
    from gguf import GGMLQuantizationType as Q

    from rackserve.model import native_ops
    hf = load_hf(request.getfixturevalue(fixture))
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "qwen3" if "qwen3" in fixture else "llama", [Q[qtype]])
    config = ModelConfig(path, "tiny", path, "float32", "cpu", None, 0, quantization="gguf", native_isa=native_isa)
    request.addfinalizer(lambda: native_ops.use_isa("auto"))         # the loader set this process's build
    model, info = load_model(config)
    packed = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert len(packed) == 4 * info.num_layers + 1           # qkv, o, gate_up, down per layer + lm_head
    assert all(m.weight is None for m in packed if m is not model.lm_head)
    if native_isa == "avx2":
        assert {type(m.quant).__name__ for m in packed} == {"Avx2Linear"}
        assert native_ops.library() is native_ops.load("avx2")
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_logits(model, info, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert float((ours - ref).abs().max()) < 0.03 * float(ref.abs().max())
    # vLLM's rule, position by position: each side's greedy token is in the other's top-5.
    ours_top5, ref_top5 = ours.topk(5).indices, ref.topk(5).indices
    assert (ours_top5 == ref.argmax(-1, keepdim=True)).any(-1).all()
    assert (ref_top5 == ours.argmax(-1, keepdim=True)).any(-1).all()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(unavailable_reason(isa="avx512") is not None, reason=str(unavailable_reason(isa="avx512")))
@pytest.mark.parametrize("mode", ["one-part", "adaptive"])
def test_a_gguf_model_with_fewer_activation_parts_keeps_vllms_top5_rule(tiny_llama_dir, mode, request, tmp_path):
    """--packed-activations through the loader: every packed linear takes the mode, and an 80-token
    prefill (calls of 80 rows) stays within vLLM's top-5 rule of the HF original's logits."""
    from gguf import GGMLQuantizationType as Q

    from rackserve.model import native_ops
    hf = load_hf(tiny_llama_dir)
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama", [Q["Q4_1"]])
    config = ModelConfig(path, "tiny", path, "float32", "cpu", None, 0, quantization="gguf", native_isa="avx512",
                         packed_activations=mode)
    request.addfinalizer(lambda: native_ops.use_isa("auto"))
    model, info = load_model(config)
    packed = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    assert packed and all(q.activation_tau is not None for q in packed)
    ids = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = prefill_logits(model, info, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours.topk(5).indices == ref.argmax(-1, keepdim=True)).any(-1).all()
    assert (ref.topk(5).indices == ours.argmax(-1, keepdim=True)).any(-1).all()


def test_one_fused_layer_of_mixed_types_is_refused(tiny_llama_dir, tmp_path):
    from gguf import GGMLQuantizationType as Q
    # q_proj Q4_0, k_proj Q4_1: one qkv_proj cannot hold both packed.
    path = write_gguf(load_hf(tiny_llama_dir), str(tmp_path / "mixed.gguf"), "llama", [Q.Q4_0, Q.Q4_1])
    with pytest.raises(ValueError, match="--quantization none"):
        load_model(ModelConfig(path, "tiny", path, "float32", "cpu", None, 0, quantization="gguf"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_bench_counts_the_bytes_the_kernel_reads(kernel, tiny_llama_dir, tmp_path):
    import dataclasses

    from gguf import GGMLQuantizationType as Q

    from rackserve.bench.forward_steps import model_cost
    # Q8_0: the kernels read it differently (int4: two groups with bf16 scales; vnni: the GGUF block).
    path = write_gguf(load_hf(tiny_llama_dir), str(tmp_path / "tiny.gguf"), "llama", [Q.Q8_0])
    quantized = ModelConfig(path, "tiny", path, "float32", "cpu", None, 0, quantization="gguf", quant_kernel=kernel)
    model, _ = load_model(quantized)
    packed = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    saved = sum(m.quant.out_features * m.quant.in_features * 4 - m.quant.weight_bytes_per_token() for m in packed)
    dense = model_cost(dataclasses.replace(quantized, quantization="none")).weight_bytes
    assert dense - model_cost(quantized).weight_bytes == saved > 0


def test_a_row_parallel_slice_keeps_its_input_columns():
    # A tensor-parallel rank of a row-parallel layer holds some input columns: it must pack exactly
    # those columns of the checkpoint's groups (and refuse a cut through a group).
    from rackserve.model.layers import RowParallelLinear
    blocks, w = random_blocks("Q8_0", rows=48, cols=128)
    layer = RowParallelLinear(128, 48, input_held=(64, 64))
    layer.load_quantized(from_gguf("Q8_0", blocks))
    layer.process_weights_after_loading()
    assert layer.weight is None and torch.equal(layer.quant.dequantize(), w[:, 64:])
    unaligned = RowParallelLinear(128, 48, input_held=(48, 80))
    with pytest.raises(ValueError, match="multiples of 32"):
        unaligned.load_quantized(from_gguf("Q8_0", blocks))
