"""A cpu calibration is reused only while the code that computed its steps is the code here:
bench/engine_code.py's record (the step path's files and the native build) and cpu_device.find."""
from __future__ import annotations

import importlib
import json

import pytest

from rackserve.bench import engine_code
from rackserve.sim import cpu_device


def _record(files: list[str], library: str | None = None) -> dict:
    return {"native_library": library, "native_decode_step": True, "files": files,
            "digest": engine_code._files_digest(files)}


def test_an_edit_to_a_file_that_ran_or_another_native_build_makes_the_record_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_code, "_ROOT", str(tmp_path))
    (tmp_path / "layer.py").write_text("x = 1\n")
    (tmp_path / "runner.py").write_text("y = 2\n")
    record = _record(["layer.py", "runner.py"])
    assert engine_code.unchanged(record)
    (tmp_path / "unrelated.py").write_text("z = 3\n")            # a file the engine never loaded
    assert engine_code.unchanged(record)
    (tmp_path / "layer.py").write_text('"""Docstring."""\n\n# a comment\nx = (1)   # the same code\n')
    assert engine_code.unchanged(record)
    (tmp_path / "layer.py").write_text('"""Docstring."""\nx = "1"\n')        # a string is code past the docstring
    assert not engine_code.unchanged(record)
    (tmp_path / "layer.py").write_text("x = 10\n")
    assert not engine_code.unchanged(record)
    (tmp_path / "layer.py").write_text("x = 1\n")
    (tmp_path / "runner.py").unlink()
    assert not engine_code.unchanged(record)
    assert not engine_code.unchanged(None) and not engine_code.unchanged({**record, "files": []})
    # A native library of other sources, flags or compiler than what would be built here now.
    (tmp_path / "runner.py").write_text("y = 2\n")
    assert not engine_code.unchanged(_record(["layer.py"], "avx512-0000000000000000"))
    # Records of several processes merge only when they ran the same engine.
    assert engine_code.merged([_record(["layer.py"]), _record(["runner.py"])])["files"] == ["layer.py", "runner.py"]
    with pytest.raises(ValueError, match="different engines"):
        engine_code.merged([_record(["layer.py"]), {**_record(["layer.py"]), "native_decode_step": False}])
    with pytest.raises(ValueError, match="predates"):
        engine_code.merged([_record(["layer.py"]), None])


def test_this_process_records_the_step_path_it_loaded():
    importlib.import_module("rackserve.executor.model_runner")     # the engine's modules, as after a run
    record = engine_code.engine_code("none", None)
    assert "rackserve/executor/model_runner.py" in record["files"] and "rackserve/model/native.py" in record["files"]
    assert not any(f.startswith("rackserve/sim/") for f in record["files"])
    assert engine_code.unchanged(record)


def test_find_skips_a_calibration_whose_code_changed(tmp_path, monkeypatch):
    key = {"processor": "p", "model": "m"}
    (tmp_path / "src.py").write_text("a = 1\n")
    monkeypatch.setattr(engine_code, "_ROOT", str(tmp_path))
    saved = tmp_path / "cal"
    saved.mkdir()
    (saved / "old.json").write_text(json.dumps({"key": key}))                   # no record: never reused
    (saved / "new.json").write_text(json.dumps({"key": key, "engine_code": _record(["src.py"])}))
    assert cpu_device.find(key, [str(saved)]) == str(saved / "new.json")
    (tmp_path / "src.py").write_text("a = 2\n")
    assert cpu_device.find(key, [str(saved)]) is None


def test_each_shipped_calibration_is_found_for_its_own_processor_only(monkeypatch):
    """The shipped keys tell a Zen 1 (family 23) from a Zen 3 (family 25), both "AMD EPYC", and
    from the Xeon: `--hardware cpu` on each finds its own file (code checks aside: accepted here)."""
    import os
    monkeypatch.setattr(engine_code, "unchanged", lambda record: True)
    shipped = {}
    for name in os.listdir(cpu_device.SHIPPED_DIR):
        with open(os.path.join(cpu_device.SHIPPED_DIR, name)) as f:
            key = json.load(f).get("key")
        if key:
            shipped[name] = key
    assert {"cpu-smollm2-gguf-zen1.json", "cpu-smollm2-gguf-zen3.json"} <= set(shipped)
    assert shipped["cpu-smollm2-gguf-zen1.json"]["processor"].startswith("AMD EPYC family 23 model 1 ")
    assert shipped["cpu-smollm2-gguf-zen3.json"]["processor"].startswith("AMD EPYC family 25 model 1 ")
    for name, key in shipped.items():
        assert cpu_device.find(key, [cpu_device.SHIPPED_DIR]) == os.path.join(cpu_device.SHIPPED_DIR, name)


def test_the_vnni_kernels_activation_parts_are_in_the_cpu_key():
    """serve's --packed-activations auto is adaptive on the vnni kernel (its prompt chunks run
    faster than two parts'): a calibration measured with two parts (the shipped ones) prices only
    `--packed-activations two-part`, and a run-time one is measured with the key's mode. Other
    kernels have no parts: their keys do not name them, and asking for fewer is refused."""
    auto = cpu_device.serve_key("smollm2-135m-instruct")
    if auto["quant_kernel"] == "vnni":
        assert auto["packed_activations"] == "adaptive"
        assert cpu_device.serve_key("smollm2-135m-instruct", None, None, "two-part") == \
            {**auto, "packed_activations": "two-part"}
    else:
        assert "packed_activations" not in auto
        with pytest.raises(ValueError, match="only the vnni kernel"):
            cpu_device.serve_key("smollm2-135m-instruct", None, None, "one-part")
    args = cpu_device._forward_args({**auto, "packed_activations": "one-part"}, "out.json", "prefill", 2048)
    assert args[args.index("--packed-activations") + 1] == "one-part"
    assert "--packed-activations" not in cpu_device._forward_args(
        {k: v for k, v in auto.items() if k != "packed_activations"}, "out.json", "prefill", 2048)


def test_the_kv_cache_dtype_is_in_the_cpu_key(tmp_path):
    """A float16 KV cache runs another decode attention kernel than a float32 one: `--kv-cache-dtype
    fp16` on cpu finds (or measures, with bench forward's --kv-cache-dtype float16) a calibration of
    its own, never the shipped float32 ones; fp8 likewise (serve's e4m3 cache, measured with its
    --kv-cache-dtype fp8); fp4 and serve's spellings are refused before anything is measured."""
    from rackserve.sim.calibrate import _as_measured
    from rackserve.sim.model_spec import load_model_spec
    from rackserve.config import resolve_kv_cache_dtype
    auto = cpu_device.serve_key("smollm2-135m-instruct")
    fp16 = cpu_device.serve_key("smollm2-135m-instruct", None, "fp16")
    # serve's auto: float16 under a float32-activation packed kernel, else the model's dtype
    assert auto["kv_cache_dtype"] == (resolve_kv_cache_dtype("auto", "cpu", auto["dtype"], auto["quant_kernel"])[0]
                                      or auto["dtype"])
    assert fp16 == {**auto, "kv_cache_dtype": "float16"}
    assert cpu_device.serve_key("smollm2-135m-instruct", None, "float16") == fp16     # serve's name too
    fp32 = cpu_device.serve_key("smollm2-135m-instruct", None, "fp32")
    assert fp32 == {**auto, "kv_cache_dtype": "float32"}
    args = cpu_device._forward_args(fp16, "out.json", "decode", 2048)
    assert args[args.index("--kv-cache-dtype") + 1] == "float16"
    fp8 = cpu_device.serve_key("smollm2-135m-instruct", None, "fp8")
    assert fp8 == {**auto, "kv_cache_dtype": "float8_e4m3fn"} == cpu_device.serve_key("smollm2-135m-instruct", None,
                                                                                       "float8_e4m3fn")
    args = cpu_device._forward_args(fp8, "out.json", "decode", 2048)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    for bad in ("fp4", "float16"):     # the simulator's names only, and those serve keeps on a CPU
        with pytest.raises(ValueError, match="on cpu"):
            cpu_device.load_cpu_device("smollm2-135m-instruct", None, str(tmp_path), bad)
    assert not list(tmp_path.iterdir())
    # What a bench forward record ran is read back with its cache's precision.
    spec = load_model_spec("smollm2-135m-instruct")
    setting = {"dtype": "float32", "kv_cache_dtype": "float16", "cost": {"weight_bytes": 4.0e8},
               "kernels": {"quant_kernel": None, "dense_above_rows": None, "native_decode_attention": True}}
    assert _as_measured(spec, {"settings": {"A": setting}})["kv_precision"] == "fp16"
    assert _as_measured(spec, {"settings": {"A": {**setting, "kv_cache_dtype": "float8_e4m3fn"}}})["kv_precision"] == "fp8"
    del setting["kv_cache_dtype"]     # a record from before the fifteenth round: the model's dtype
    assert _as_measured(spec, {"settings": {"A": setting}})["kv_precision"] == "fp32"
