"""A tiny random-weight Llama with SmolLM2's tokenizer, for fast tests and the soak.

`tiny_model_dir(cache_dir)` writes it once as a Hugging Face directory (load it with
model.source = "hf_dir", model.path = that directory). Same seed -> same weights -> same
fingerprint, so a tiny model's cold blocks survive a restart like the real model's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvagentd.engine.model import EMBEDDED_FILE, embedded_gguf_path

TINY_NAME = "tiny-llama-v1"


def tiny_model_dir(cache_dir: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4,
                   kv_heads: int = 2, seed: int = 0) -> Path:
    """Path of the tiny model directory under `cache_dir/models/`, created on first use."""
    root = Path(cache_dir) / "models"
    final = root / f"{TINY_NAME}-l{layers}-h{hidden}-a{heads}-kv{kv_heads}-s{seed}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").is_file():
            return final
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _build(tmp, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seed=seed)
        os.rename(tmp, final)
    return final


def _build(out: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _smollm2_tokenizer(out.parent)
    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "initializer_range": 0.2,
    }
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _smollm2_tokenizer(models_root: Path) -> Any:
    """SmolLM2's tokenizer: from a converted copy when one exists, else from the GGUF."""
    from transformers import AutoTokenizer

    for cand in sorted(models_root.glob(f"{Path(EMBEDDED_FILE).stem}-*")):
        if (cand / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cand), local_files_only=True)
    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                         local_files_only=True)
