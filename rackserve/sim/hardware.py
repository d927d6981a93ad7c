"""Hardware: one device's published peaks (dense FLOP/s per precision, memory bandwidth and
capacity, scale-up and scale-out link bandwidth), the table of named devices, and loading a device
from a JSON file (a saved `cpu` calibration is one).

Peaks are the vendors' dense (not sparse) figures per GPU; links are per direction. What fraction
of a peak a kernel reaches lives in efficiency.py, never here. This file must never time a step.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

TFLOPS, TBPS, GBPS, GIB = 1e12, 1e12, 1e9, 1 << 30


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: dict[str, float]         # dense FLOP/s by compute precision (bf16, fp8, fp4)
    mem_bw: float                   # bytes/s of device memory
    mem_capacity: float             # bytes
    scale_up_bw: float              # bytes/s per direction inside the NVLink (or xGMI) domain
    scale_out_bw: float             # bytes/s per direction per device across domains (RDMA NIC)
    domain_size: int                # devices in one scale-up domain
    link_latency: float = 2e-6      # seconds per collective hop
    step_overhead: float = 0.0      # seconds per step outside the model (scheduling, launches, sampling)
    seq_overhead: float = 0.0       # seconds per scheduled sequence per step (metadata, sampling, gathers)
    layer_overhead: float = 0.0     # seconds per layer per step however small the batch (kernel floors)
    kernel_overhead: float = 0.0    # the floor of one kernel: what each kernel a layer kind adds costs a step
    # What a server's serving path (output processing, detokenization, SSE, the event loop, the
    # benchmark client) adds to a step where it shares the cores with it: a CPU. Measured from a
    # `bench serve` run (sim/serve_path.py); 0 on GPUs, whose host CPUs run it beside the kernels.
    serve_step_overhead: float = 0.0   # seconds per step
    serve_seq_overhead: float = 0.0    # seconds per sequence that streams a token that step
    # A served step's model time over bench forward's for the same batch: the serving path's threads
    # and the client take cores from the model's threads while it runs (1 on GPUs). Steps of decodes
    # alone share the cores otherwise than steps with a prompt chunk: their own factor (None: the same).
    serve_slowdown: float = 1.0
    serve_decode_slowdown: float | None = None
    # A request's front path outside the engine (HTTP, the chat template, tokenization, the first
    # chunk's SSE): seconds a request + seconds a prompt token, measured by bench/front_path.py.
    serve_request_overhead: float = 0.0
    serve_prompt_token_overhead: float = 0.0
    # How a served step's time spreads around what its shape costs (the host's other tenants, the
    # cores shared with the serving path), measured by sim/serve_path.py: quantiles of a step over its
    # request's median, one per equal share of steps, drawn each step; and each request's median over
    # the median request's, drawn afresh every `serve_slow_seconds` of steps. Empty: none (GPUs).
    serve_step_spread: tuple[float, ...] = ()
    serve_slow_spread: tuple[float, ...] = ()
    serve_slow_seconds: float = 0.0
    # The attention backend pads a step's decodes to the longest one's context (model/
    # torch_attention.py on a CPU: one gathered, masked batch), so each decode costs the longest
    # context; GPU paged kernels read each sequence's own.
    pads_decodes: bool = False
    # Steps of decodes alone where the engine runs them in one native call (model/native_decode.py;
    # bench forward records it in engine_code): another code path than the prefill and mixed steps',
    # so their measured time over the cost model's is fitted apart (1: the same path).
    decode_scale: float = 1.0
    # Threads the native decode attention splits a step's decodes over (sim/cpu_attention.py: its
    # busiest thread sets the pace); 0 where the cost model prices decode attention as evenly shared.
    decode_attn_threads: int = 0
    # The native library's build those threads ran (its split rule differs: sim/cpu_attention.RULES).
    decode_attn_isa: str = "avx512"
    # Whether compute and memory traffic overlap within an op (GPUs: time = max of the two); a CPU
    # core mostly waits for one, then the other (time = their sum).
    overlap: bool = True
    efficiency: dict[str, float] = field(default_factory=dict)  # overrides of efficiency.py by op class
    source: str = ""

    def peak_flops(self, precision: str) -> float:
        """FLOP/s at `precision`; a precision the device lacks runs at the next wider one."""
        for p in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(precision, ("bf16",)):
            if p in self.flops:
                return self.flops[p]
        return self.flops["fp32"]

    def to_json(self) -> dict:
        return asdict(self)


KERNEL_FLOOR = 3e-6     # seconds a GPU kernel lasts however little it does (below)
LAYER_KERNELS = 10      # kernels of a decode layer every architecture runs (below)


def _gpu(name: str, bf16: float, fp8: float, fp4: float | None, tbps: float, gb: float, up_gbps: float,
         out_gbps: float, domain: int, source: str, layer_overhead: float = LAYER_KERNELS * KERNEL_FLOOR) -> Hardware:
    flops = {"bf16": bf16 * TFLOPS, "fp8": fp8 * TFLOPS}
    if fp4:
        flops["fp4"] = fp4 * TFLOPS
    # A serving step on a GPU costs ~30 us of launches and bookkeeping beyond its kernels with
    # CUDA graphs (vLLM's own profiles). A decode layer is ~10 kernels (norms, projections,
    # attention, gate, dispatch, experts, combine), each lasting at least ~3 us however little it
    # does: ~30 us a layer, the floor of small batches; a layer kind that launches more kernels (a
    # DeepSeek-V4 compressor, its indexer: attention_work.py) adds 3 us for each. efficiency.py holds
    # the per-op fractions.
    from rackserve.sim.efficiency import DEVICE_EFFICIENCY
    return Hardware(name, flops, tbps * TBPS, gb * 1e9, up_gbps * GBPS, out_gbps * GBPS, domain,
                    step_overhead=30e-6, layer_overhead=layer_overhead, kernel_overhead=KERNEL_FLOOR,
                    efficiency=dict(DEVICE_EFFICIENCY.get(name, {})), source=source)


# The seeds' VR200 low-latency decode path: packed FP4 weight stages (7 -> 11 shared-memory stages)
# save 57 us a step, the shared expert folded into the routed GEMM 220 us a step below 16 rows:
# 277 us less of kernel floors a step than GB300's kernels, spread over DeepSeek-V4's 43 layers.
VR200_LAYER_OVERHEAD = LAYER_KERNELS * KERNEL_FLOOR - 277e-6 / 43


# Vendors' datasheets (dense, per GPU). Links: NVLink 4 900 GB/s and NVLink 5 1.8 TB/s are
# bidirectional totals, halved here; NICs are 400 Gb/s (ConnectX-7) or 800 Gb/s (ConnectX-8).
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    _gpu("H100", 989, 1979, None, 3.35, 80, 450, 50, 8, "NVIDIA H100 SXM datasheet"),
    _gpu("H200", 989, 1979, None, 4.8, 141, 450, 50, 8, "NVIDIA H200 SXM datasheet"),
    _gpu("B200", 2250, 4500, 9000, 8.0, 180, 900, 50, 8, "NVIDIA HGX B200 datasheet"),
    _gpu("GB200", 2500, 5000, 10000, 8.0, 186, 900, 50, 72, "NVIDIA GB200 NVL72 datasheet, per GPU"),
    _gpu("GB300", 2500, 5000, 15000, 8.0, 288, 900, 100, 72, "NVIDIA GB300 NVL72 datasheet, per GPU"),
    _gpu("MI355X", 2500, 5000, 10000, 8.0, 288, 538, 50, 8, "AMD Instinct MI355X datasheet (7 xGMI links, 1075 GB/s)"),
    # The seeds' ratios to GB200: 5x NVFP4, ~2.4x HBM bandwidth, 1.7x NVLink; 288 GB HBM4.
    # BF16/FP8 are not in the seeds: scaled from GB200 by the FP8 ratio NVIDIA announced (3.5x).
    _gpu("VR200", 8750, 17500, 50000, 19.2, 288, 1530, 100, 72,
         "Vera Rubin NVL72 per GPU: FP4, HBM and NVLink from the seeds' ratios to GB200; BF16/FP8 estimated; "
         "achieved fractions and kernel floors from the seeds (efficiency.py, VR200_LAYER_OVERHEAD)",
         VR200_LAYER_OVERHEAD),
)}


def load_hardware(name_or_file: str) -> Hardware:
    """A device of the table, `cpu` (the saved calibration of this machine), or a JSON file."""
    if name_or_file in HARDWARE:
        return HARDWARE[name_or_file]
    if name_or_file == "cpu":
        from rackserve.sim.calibrate import load_cpu
        return load_cpu()
    if not os.path.isfile(name_or_file):
        raise ValueError(f"hardware {name_or_file!r} is neither a known device ({', '.join(HARDWARE)}, cpu) "
                         "nor a JSON file")
    with open(name_or_file) as f:
        d = json.load(f)
    for key in ("measured", "held_out", "command"):   # a calibration's record of how it was made
        d.pop(key, None)
    return Hardware(**d)
