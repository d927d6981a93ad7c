"""GGUF weights kept quantized (--quantization gguf): Q4_0, Q4_1 and Q8_0 blocks decoded into int4
groups exactly as gguf-py dequantizes them, each quantized-linear kernel (torch's int4, our vnni)
against the fp32 matmul of the dequantized weight, the kernel choice from given CPU flags, and tiny
GGUF models loaded quantized against their HF originals.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rackserve.config import ModelConfig
from rackserve.model.loader import load_model
from rackserve.cpu_dtype import cpu_flags
from rackserve.model.quant.gguf_blocks import from_gguf
from rackserve.model.quant.int4_linear import DENSE_ABOVE_ROWS
from rackserve.model.native import CPU_FLAGS
from rackserve.model.quant.kernel_choice import choose_quant_kernel
from rackserve.model.quant.quantized_linear import QUANT_KERNELS
from tests.test_model_gguf import write_gguf
from tests.test_model_parity import prefill_logits
from tests.tiny_models import load_hf

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]
VNNI = choose_quant_kernel(cpu_flags())
KERNELS = ["int4", pytest.param("vnni", marks=pytest.mark.skipif(VNNI.name != "vnni", reason=VNNI.reason))]
# Largest error of an output, relative to its row's largest: torch's int4 kernel rounds activations
# and outputs to bf16 (~0.4%); vnni's two int8 parts of each activation leave ~1e-5. A wrong scale
# or zero of one group out of six shifts outputs by tens of percent.
TOLERANCE = {"int4": 2e-2, "vnni": 2e-4}


def random_blocks(qtype: str, rows: int = 72, cols: int = 192, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF blocks of a random weight (rows not a multiple of the kernel's 16), and their fp32 values
    as gguf-py dequantizes them. An offset makes Q4_1's minimum and the zeros matter."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) + 0.5
    blocks = quantize(w, Q[qtype])
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
@pytest.mark.parametrize("rows", [1, 7, DENSE_ABOVE_ROWS + 3, 515])   # 515: above vnni's dense_above_rows too
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


def test_the_kernel_choice_follows_the_cpu_flags_and_the_build(tmp_path):
    from rackserve.model.native import build_library
    (tmp_path / "a-file").write_text("")
    unwritable = choose_quant_kernel(set(CPU_FLAGS), build=lambda: build_library(str(tmp_path / "a-file" / "kernels")))
    assert unwritable.name == "int4" and "failed" in unwritable.reason

    def fails():
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    assert choose_quant_kernel(set(CPU_FLAGS), build=lambda: "lib.so").name == "vnni"
    no_vnni = choose_quant_kernel(set(CPU_FLAGS) - {"avx512_vnni"}, build=lambda: "lib.so")
    assert no_vnni.name == "int4" and "avx512_vnni" in no_vnni.reason
    unbuilt = choose_quant_kernel(set(CPU_FLAGS), build=fails)
    assert unbuilt.name == "int4" and "no C++ compiler" in unbuilt.reason
    assert choose_quant_kernel(set()).name == "int4"          # /proc/cpuinfo unreadable: nothing assumed


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


@pytest.mark.parametrize("fixture,qtype", [("tiny_llama_dir", "Q4_1"), ("tiny_llama3_rope_dir", "Q8_0"),
                                           ("tiny_qwen3_dir", "Q4_0")])
def test_tiny_gguf_kept_quantized_matches_its_hf_original(fixture, qtype, request, tmp_path):
    from gguf import GGMLQuantizationType as Q
    hf = load_hf(request.getfixturevalue(fixture))
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "qwen3" if "qwen3" in fixture else "llama", [Q[qtype]])
    model, info = load_model(ModelConfig(path, "tiny", path, "float32", "cpu", None, 0, quantization="gguf"))
    packed = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert len(packed) == 4 * info.num_layers + 1           # qkv, o, gate_up, down per layer + lm_head
    assert all(m.weight is None for m in packed if m is not model.lm_head)
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
