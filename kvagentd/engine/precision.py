"""The precision the model runs in: `model.dtype = "auto"` measured on this machine.

- CUDA: bfloat16.
- A CPU without native bf16 (no `avx512_bf16`, no `amx_bf16`): float32. bf16 is emulated
  there: a 512-token prefill measured 5-6x slower than fp32 (BENCHMARKS, precision).
- A CPU with native bf16: bf16 weights and KV if, on the caller's own prompts (the agent's
  tick prompts with their decoding constraints), greedy decoding in bf16 gives the same text
  as fp32 on at least `AGREEMENT` of them; otherwise float32. The verdict is kept under
  `<cache_dir>/precision/`, keyed by the model, the prompts, torch and the CPU flags, so the
  check runs once per model and machine.

`DtypeChoice` says what was chosen and why (status shows it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import xxhash

from kvagentd.engine.constraints import Constraints, Rules, choose
from kvagentd.engine.sequence import sentence_end
from kvagentd.engine.sessions import ChatFormat

log = structlog.get_logger(__name__)

AGREEMENT = 0.9  # share of calibration answers bf16 must write exactly as fp32 does
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True, slots=True)
class Calibration:
    """One prompt of the caller's own: a first turn, its constraints and limits."""

    system: str | None
    text: str
    constraints: Constraints | None
    max_new_tokens: int
    one_sentence: bool = True


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    prompts: int = 0  # calibration prompts compared (0: not measured)
    same_text: int = 0
    max_logit_error: float | None = None  # first-token logits, bf16 against fp32

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "reason": self.reason,
                "calibration_prompts": self.prompts, "same_text": self.same_text,
                "first_token_logits_max_error": self.max_logit_error}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[-1].split())
    return frozenset()


def static_choice(name: str, device: torch.device, flags: frozenset[str]) -> DtypeChoice | None:
    """The choice that needs no measurement, or None when `auto` must measure bf16."""
    if name != "auto":
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[name]
        return DtypeChoice(dt, f"model.dtype = {name!r}")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: bfloat16 on CUDA")
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if not native:
        return DtypeChoice(torch.float32, "auto: float32; this CPU has no native bf16 "
                                          "(avx512_bf16, amx_bf16), where bf16 is emulated "
                                          "and slower")
    return None


class _Row:
    """A calibration answer as `constraints.choose` reads a sequence."""

    def __init__(self, rules: Rules | None, opening: list[int]) -> None:
        self.rules = rules
        self.guard_gave_up = False
        self.answer = list(opening)

    def banned_next(self) -> set[int]:
        return self.rules.banned_next(self.answer) if self.rules else set()

    def text_with(self, token: int, tokenizer: Any) -> str:
        return str(tokenizer.decode(self.answer + [token], skip_special_tokens=True))


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, prompts: Sequence[Calibration],
                   before_each: Callable[[], None] = lambda: None
                   ) -> tuple[list[str], list[torch.Tensor]]:
    """Each prompt's greedy answer under its constraints (as the engine decodes it: opening,
    masks, guard, one sentence, stop ids) and its first-token logits, one prompt at a time
    through transformers' DynamicCache. `before_each` runs before each prompt (it may raise
    to stop the run)."""
    from transformers import DynamicCache

    chat = ChatFormat(tokenizer)
    texts: list[str] = []
    firsts: list[torch.Tensor] = []
    for p in prompts:
        before_each()
        rules = Rules(p.constraints, tokenizer) if p.constraints else None
        opening = rules.opening_ids if rules else []
        row = _Row(rules, opening)
        x = torch.tensor([chat.first_turn(p.system, p.text) + opening])
        cache = DynamicCache(config=model.config)
        first: torch.Tensor | None = None
        text = ""
        for _ in range(max(0, p.max_new_tokens - len(opening))):
            logits = model(input_ids=x, cache=cache, logits_to_keep=1).logits[:, -1].float()
            if first is None:
                first = logits[0].clone()
            tok = choose(logits, [row], tokenizer)[0]
            row.answer.append(tok)
            if tok in chat.stop_ids:
                break
            text = str(tokenizer.decode(row.answer, skip_special_tokens=True))
            end = sentence_end(text) if p.one_sentence else None
            if end is not None:
                text = text[:end]
                break
            x = torch.tensor([[tok]])
        texts.append(text or str(tokenizer.decode(row.answer, skip_special_tokens=True)))
        firsts.append(first if first is not None else torch.zeros(1))
    return texts, firsts


def verdict_path(cache_dir: Path, fingerprint: str, prompts: Sequence[Calibration],
                 flags: frozenset[str]) -> Path:
    h = xxhash.xxh3_64()
    for p in prompts:
        c = p.constraints
        h.update(f"{p.system}\0{p.text}\0{p.max_new_tokens}\0{p.one_sentence}\0".encode())
        if c is not None:
            h.update(f"{c.opening}\0{'|'.join(c.banned)}\0{c.no_repeat}\0".encode())
    h.update(f"{torch.__version__}\0{' '.join(sorted(flags))}".encode())
    return Path(cache_dir) / "precision" / f"{fingerprint[:32]}-{h.hexdigest()}.json"


def load_verdict(path: Path) -> DtypeChoice | None:
    try:
        d = json.loads(path.read_text())
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[d["dtype"]]
        return DtypeChoice(dt, str(d["reason"]), int(d["calibration_prompts"]),
                           int(d["same_text"]), d.get("first_token_logits_max_error"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_verdict(path: Path, choice: DtypeChoice) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(choice.as_dict(), indent=1) + "\n")
    os.replace(tmp, path)


def compare(fp32: tuple[list[str], list[torch.Tensor]],
            bf16: tuple[list[str], list[torch.Tensor]]) -> DtypeChoice:
    """bf16's answers against fp32's: bf16 when at least `AGREEMENT` of them are the same."""
    (t32, l32), (t16, l16) = fp32, bf16
    same = sum(a == b for a, b in zip(t32, t16))
    n = len(t32)
    err = max((float((a - b).abs().max()) for a, b in zip(l32, l16)), default=0.0)
    share = same / n if n else 0.0
    if n and share >= AGREEMENT:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16 (native on this CPU): the same "
                           f"answer as float32 on {same} of {n} calibration prompts",
                           n, same, err)
    return DtypeChoice(torch.float32, f"auto: float32; bfloat16 gave the same answer as "
                       f"float32 on only {same} of {n} calibration prompts (needs "
                       f"{AGREEMENT:.0%})" if n else "auto: float32; no calibration prompts "
                       "to check bfloat16 with", n, same, err)
