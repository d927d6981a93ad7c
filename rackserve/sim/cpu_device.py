"""The `cpu` device at run time: the calibration of this machine for the model, dtype and
quantization `rackserve serve` would run, found among the saved ones or measured on the spot.

A calibration is keyed by what makes its step times true: the processor (model name, family and
model, logical CPUs), the model, the dtype, the KV cache's dtype, the quantization and the kernels
(resolved as `rackserve serve` resolves them: auto dtype by the CPU's flags, a GGUF's weights kept
packed, the packed kernel `--quant-kernel auto` picks, the native library's build), and it is
reused only while the code that computed its steps is unchanged (its engine_code record,
bench/engine_code.py: the native library's digest, the step path's Python code, the native decode
step's use). `rackserve sim --hardware cpu` looks in --calibration-dir (default
~/.cache/rackserve/sim), then in the calibrations shipped in sim/calibration/; when none matches it
runs a quick `bench forward` (decode at batch 1-16 and context 256-2048, prefill of 256 tokens at
batch 1 and 4 and of 64 at batch 1 and 2; a second each, in one child process so the simulator
itself never imports torch), fits the device (calibrate.py) and saves it there for the next run.
This file owns the key and the lookup; it must never time a step itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zlib

from rackserve.config import KV_CACHE_DTYPE_NAMES
from rackserve.cpu_dtype import cpu_identity
from rackserve.sim.hardware import Hardware

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "calibration")
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rackserve", "sim")
DECODE_BATCHES, DECODE_CONTEXTS = "1,4,16", (256, 2048)
PREFILL_BATCHES, PREFILL_TOKENS = "1,4", 256
# Mid-size steps (64 and 128 rows): where a packed model's weight-only kernel multiplies, at its own
# rate (calibrate.py fits it), and where a served workload's uncached prompt tails fall.
MID_BATCHES, MID_TOKENS = "1,2", 64
FORWARD_SECONDS = 1.0       # timed per point: medians of 5-40 steps


def processor() -> str:
    """The CPU's model name, family and model (cpu_identity) and logical CPU count (what bench
    forward's threads default to)."""
    return f"{cpu_identity()} x{os.cpu_count()}"


# The KV caches `rackserve serve` keeps on a CPU, by the simulator's precision names and serve's
# (--kv-cache-dtype's, config.KV_CACHE_DTYPE_NAMES for its 8-bit ones, and the torch names its
# settings record), as the torch names a key holds.
KV_CACHE_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
                   **{name: name for name in ("float32", "float16", "bfloat16", *KV_CACHE_DTYPE_NAMES.values())},
                   **KV_CACHE_DTYPE_NAMES}
# serve's --kv-cache-dtype for a key's torch name where they differ.
_SERVE_KV_NAMES = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}


def serve_key(model: str, quantization: str | None = None, kv_cache_dtype: str | None = None,
              packed_activations: str | None = None) -> dict[str, str]:
    """What a calibration must have been measured with to price `rackserve serve --model MODEL`'s
    steps on this machine (`quantization`: gguf or none; None: serve's auto; `kv_cache_dtype`: fp32,
    fp16, bf16 or fp8 (or serve's names); None: serve's auto; `packed_activations`: serve's
    --packed-activations, None: its auto). The KV cache's dtype is in the key, not only its bytes:
    decode attention over a float16 cache runs another kernel, partly bound by its arithmetic, than
    over a float32 one. The vnni kernel's activation parts are in it too (a prompt chunk's linears
    run ~1.15-1.4x faster with fewer); no other kernel has them, and their keys do not name them."""
    from rackserve.config import (resolve_dtype, resolve_kv_cache_dtype, resolve_model_path,
                                  resolve_packed_activations, resolve_quantization)
    if quantization not in (None, "auto", "gguf", "none"):
        raise ValueError(f"--quantization {quantization} on cpu: rackserve serve runs gguf or none here")
    from rackserve.model.native import resolve_native_isa
    from rackserve.model.quant.kernel_choice import resolve_quant_kernel
    path = resolve_model_path(model)
    quant = resolve_quantization(quantization or "auto", path)
    # The kernels serve would choose here (its --quant-kernel auto, its --native-isa auto build): a
    # calibration measured with others prices steps that no longer run. Whether their code is still
    # the code here is the calibration's "engine_code" record (bench/engine_code.py), checked by find.
    kernel = resolve_quant_kernel("auto", quant, "cpu").name if quant == "gguf" else None
    dtype = resolve_dtype("auto", "cpu", kernel)[0]
    if kv_cache_dtype not in (None, "auto", *KV_CACHE_DTYPES):
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} on cpu: rackserve serve keeps fp32, fp16, bf16 or fp8 "
                         "KV caches here")
    if kv_cache_dtype in (None, "auto"):
        kv = resolve_kv_cache_dtype("auto", "cpu", dtype, kernel)[0] or dtype
    else:
        kv = KV_CACHE_DTYPES[kv_cache_dtype]
    key = {"processor": processor(), "model": model, "dtype": dtype, "quantization": quant, "quant_kernel": kernel,
           "native_isa": resolve_native_isa("auto", "cpu").isa, "kv_cache_dtype": kv}
    activations = resolve_packed_activations(packed_activations or "auto", kernel)[0]
    if kernel == "vnni":
        key["packed_activations"] = activations
    elif activations != "two-part":
        raise ValueError(f"--packed-activations {packed_activations} on cpu: only the vnni kernel has it, "
                         f"and serve runs {kernel} here")
    return key


def find(key: dict[str, str], directories: list[str]) -> str | None:
    """The first saved calibration whose key is `key` and whose steps ran the code here now (its
    engine_code record unchanged: a calibration measured before an edit to the step path's code or
    its native sources, or without the record, is never reused)."""
    from rackserve.bench.engine_code import unchanged
    for directory in directories:
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path) as f:
                    saved = json.load(f)
                if saved.get("key") == key and unchanged(saved.get("engine_code")):
                    return path
            except (OSError, ValueError):
                continue    # a file being written by another run, or not a calibration
    return None


def _forward_args(key: dict[str, str], out: str, mode: str, max_model_len: int) -> list[str]:
    """`rackserve bench forward`'s arguments for one of the calibration's three sets of points."""
    contexts = [c for c in DECODE_CONTEXTS if c < max_model_len] or [max_model_len // 2]
    args = ["--mode", "decode", "--batch-sizes", DECODE_BATCHES, "--context-lens", ",".join(map(str, contexts))]
    if mode in ("prefill", "mid"):
        batches, tokens = (PREFILL_BATCHES, PREFILL_TOKENS) if mode == "prefill" else (MID_BATCHES, MID_TOKENS)
        args = ["--mode", "prefill", "--batch-sizes", batches, "--context-lens", "0", "--new-tokens", str(tokens)]
    return ["bench", "forward", "--model", key["model"], "--device", "cpu", "--dtype", key["dtype"],
            "--quantization", key["quantization"],
            "--kv-cache-dtype", _SERVE_KV_NAMES.get(key["kv_cache_dtype"], key["kv_cache_dtype"]),
            *(["--packed-activations", key["packed_activations"]] if "packed_activations" in key else []),
            "--seconds", str(FORWARD_SECONDS), "--warmup-steps", "2",
            *args, "--output", out]


def _bench_forwards(runs: list[list[str]]) -> None:
    """The runs of bench forward, one after another in one child process (torch and the engine's
    modules load once, and the simulator itself never imports torch)."""
    cmd = [sys.executable, "-m", "rackserve.sim.cpu_device", json.dumps(runs)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        commands = "; ".join("rackserve " + " ".join(run) for run in runs)
        raise ValueError(f"calibrating cpu: bench forward failed ({commands}):\n{done.stderr[-2000:]}")


def _run_forwards(runs_json: str) -> int:
    """The child's side of _bench_forwards: each run through the CLI, stopping at the first that fails."""
    from rackserve.serve.cli import main
    for run in json.loads(runs_json):
        rc = main(run)
        if rc:
            return rc
    return 0


def calibrate_now(key: dict[str, str], directory: str) -> str:
    """Measure this machine with bench forward, fit the device, save it under `directory`."""
    from rackserve.sim.calibrate import fit_forward_results, save
    from rackserve.sim.model_spec import load_model_spec
    max_model_len = load_model_spec(key["model"]).max_model_len
    print(f"rackserve sim: no cpu calibration for {key}; measuring one with bench forward (about a minute)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        modes = ("decode", "prefill", "mid")
        paths = [os.path.join(tmp, f"forward-{mode}.json") for mode in modes]
        _bench_forwards([_forward_args(key, path, mode, max_model_len) for mode, path in zip(modes, paths)])
        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
    from rackserve.bench.engine_code import merged
    hw, as_measured, measured = fit_forward_results(results, key["model"], "measured at run time by rackserve sim")
    code = merged([r["settings"]["A"].get("engine_code") for r in results])
    os.makedirs(directory, exist_ok=True)
    name = f"{key['model']}-{key['dtype']}-{key['quantization']}-kv-{key['kv_cache_dtype']}"
    safe = "".join(c if c.isalnum() else "-" for c in name)
    path = os.path.join(directory, f"cpu-{safe}-{zlib.crc32(key['processor'].encode()):08x}.json")
    save(path, hw, as_measured, measured, [], ["rackserve", "sim", "--hardware", "cpu"], key, engine_code=code)
    print(f"rackserve sim: saved the cpu calibration to {path}", file=sys.stderr)
    return path


def load_cpu_device(model: str, quantization: str | None, directory: str | None,
                    kv_cache_dtype: str | None = None,
                    packed_activations: str | None = None) -> tuple[Hardware, dict, str]:
    """The `cpu` device for `model` (its calibration found or measured), what the model ran as when
    it was measured (calibrate.calibrated_spec), and the calibration's file."""
    from rackserve.sim.calibrate import load_calibration
    directory = directory or DEFAULT_DIR
    if kv_cache_dtype not in (None, "fp32", "fp16", "bf16", "fp8"):
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} on cpu: rackserve serve keeps fp32, fp16, bf16 or fp8 "
                         "KV caches here")
    key = serve_key(model, quantization, kv_cache_dtype, packed_activations)
    path = find(key, [directory, SHIPPED_DIR]) or calibrate_now(key, directory)
    hw, as_measured = load_calibration(path)
    return hw, as_measured, path


def load_device(hardware: str, model: str, quantization: str | None, directory: str | None,
                kv_cache_dtype: str | None = None,
                packed_activations: str | None = None) -> tuple[Hardware, dict | None, str | None]:
    """--hardware resolved: a device of the table, `cpu` (found or measured for `model`), or a
    JSON file (a calibration's record of how the model ran comes with it); and the calibration file."""
    from rackserve.sim.calibrate import load_calibration
    from rackserve.sim.hardware import HARDWARE, load_hardware
    if hardware == "cpu":
        return load_cpu_device(model, quantization, directory, kv_cache_dtype, packed_activations)
    if hardware in HARDWARE or not os.path.isfile(hardware):
        return load_hardware(hardware), None, None
    hw, as_measured = load_calibration(hardware)
    return hw, (as_measured or None), hardware


if __name__ == "__main__":
    sys.exit(_run_forwards(sys.argv[1]))
