"""The engine service: model + sessions + continuous-batching executor over one KV store.

Wiring (the store is built from the model's geometry and namespace, before the engine):

    loaded = load_model(config.model, config.daemon.cache_dir)
    geometry = model_geometry(loaded.model, config.kv.block_tokens, loaded.dtype)
    namespace = make_namespace(loaded.fingerprint, loaded.dtype, config.kv.block_tokens)
    store = TieredKVStore(geometry, namespace, ..., device=loaded.device)
    engine = Engine(loaded, store, state_dir=config.daemon.state_dir,
                    executor_config=config.executor, registry=daemon.metrics)
    engine.start() ... engine.stop()   # stop before store.close()

The engine switches the model to its own attention (`attention.py`); any other call on the
model still behaves as sdpa.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from kvagentd.config import ExecutorConfig
from kvagentd.engine.blocks import BatchMemoryExceeded, BlockManager, Layout
from kvagentd.engine.executor import Executor, GenerationRequest, Job, Priority, SessionBusy
from kvagentd.engine.metrics import EngineMetrics
from kvagentd.engine.model import LoadedModel, cpu_native_bf16
from kvagentd.engine.memo import LogitsMemo
from kvagentd.engine.rows import BatchRows
from kvagentd.engine.runner import ModelRunner
from kvagentd.engine.job import GenerationResult
from kvagentd.engine.sessions import ChatFormat, Session, SessionGuard, SessionStore
from kvagentd.kvcache.base import KVStore, Tier

log = structlog.get_logger(__name__)


LAST_TURNS = 6  # turns `get` shows of a session (the transcript has them all)


class SessionView:
    """Sessions as the control API and the agent see them (ids, tokens, blocks per tier)."""

    def __init__(self, table: SessionStore, store: KVStore, executor: Executor,
                 tokenizer: Any, chat: ChatFormat | None = None) -> None:
        self.table = table
        self.store = store
        self.executor = executor
        self.tokenizer = tokenizer
        self.chat = chat

    def list(self) -> list[dict[str, Any]]:
        tiers = self._tiers()
        return [self._describe(s, tiers) for s in self.table.list()]

    def get(self, session_id: str, *, tail_chars: int = 400) -> dict[str, Any] | None:
        s = self.table.get(session_id)
        if s is None:
            return None
        out = self._describe(s, self._tiers())
        text = str(self.tokenizer.decode(s.token_ids, skip_special_tokens=False))
        out["tail"] = text[-tail_chars:]
        turns = self.chat.turns(text) if self.chat is not None else None
        if turns is not None:
            out["last_turns"] = turns[-LAST_TURNS:]
        return out

    def conversation(self, session_id: str) -> builtins.list[dict[str, str]] | None:
        """The session's turns as `[{"role", "text"}]` (the template's markers read, not
        shown), or None when unknown or the template's markers cannot be read."""
        text = self.text(session_id)
        if text is None or self.chat is None:
            return None
        return self.chat.turns(text)

    def tokens(self, session_id: str) -> int:
        s = self.table.get(session_id)
        return len(s.token_ids) if s else 0

    def token_ids(self, session_id: str) -> builtins.list[int]:
        s = self.table.get(session_id)
        return list(s.token_ids) if s else []

    def exists(self, session_id: str) -> bool:
        return self.table.get(session_id) is not None

    def record(self, session_id: str) -> Session | None:
        """The stored session (token ids, owner ...), or None."""
        return self.table.get(session_id)

    def create(self, session_id: str, owner: int, *, token_ids: Sequence[int] = (),
               turns: int = 0) -> bool:
        """Create a session owned by uid `owner` (with `token_ids` for a fork; its blocks are
        found again by prefix match, never copied). False when the id exists."""
        return self.table.create(Session(session_id, list(token_ids), turns=turns, owner=owner))

    def discard_empty(self, session_id: str) -> bool:
        """Forget the session if no turn of it ever ran (a failed or cancelled first ask),
        with the references its attempt left on stored blocks (a matched shared prefix), so
        that no listing shows a session that GET /v1/sessions/{id} does not know."""
        if not self.table.discard_empty(session_id):
            return False
        self.store.drop_session(session_id, self.store.keys_of_session(session_id))
        return True

    def text(self, session_id: str) -> str | None:
        """The whole conversation as text (special tokens kept), or None."""
        s = self.table.get(session_id)
        if s is None:
            return None
        return str(self.tokenizer.decode(s.token_ids, skip_special_tokens=False))

    def drop(self, session_id: str) -> bool:
        """Forget the session and its references to blocks; False if unknown."""
        if self.executor.session_busy(session_id):
            raise SessionBusy(f"session {session_id!r} has a request in progress")
        s = self.table.drop(session_id)
        if s is None:
            return False
        self.store.drop_session(session_id, s.block_keys)
        log.info("session_dropped", session=session_id, tokens=len(s.token_ids))
        return True

    def _tiers(self) -> dict[bytes, str]:
        return {b.key: (b.tier.value if isinstance(b.tier, Tier) else "moving")
                for b in self.store.snapshot()}

    @staticmethod
    def _describe(s: Session, tiers: dict[bytes, str]) -> dict[str, Any]:
        counts = {"hot": 0, "warm": 0, "cold": 0, "moving": 0, "missing": 0}
        for k in s.block_keys:
            counts[tiers.get(k, "missing")] += 1
        d = s.summary()
        d["blocks_by_tier"] = counts
        return d


def kv_layout(name: str, device: torch.device) -> Layout:
    """`auto`: read the hot pool in place on CUDA (no second copy of the KV in GPU memory);
    a contiguous working copy on CPU, where it measured faster (see `paged.py`)."""
    if name == "contiguous" or name == "paged":
        return name  # type: ignore[return-value]
    return "paged" if device.type == "cuda" else "contiguous"


class Engine:
    """Service: `start()` starts the model worker, `stop()` drains it; `status()` for /v1/status."""

    def __init__(self, loaded: LoadedModel, store: KVStore, *, state_dir: Path,
                 executor_config: ExecutorConfig | None = None, registry: Any = None,
                 session_guard: SessionGuard | None = None) -> None:
        self.loaded = loaded
        self.store = store
        self.metrics = EngineMetrics(registry)
        self.table = SessionStore(Path(state_dir), guard=session_guard)
        self.chat = ChatFormat(loaded.tokenizer)
        cfg = executor_config or ExecutorConfig()
        device = store.hot_arena().device
        layout = kv_layout(cfg.kv_layout, device)
        rows = None
        if layout == "contiguous" and cfg.row_tokens > 0:
            need = BatchRows.bytes_for(store.geometry, cfg.max_batch, cfg.row_tokens)
            if need > int(cfg.batch_memory_bytes):
                raise BatchMemoryExceeded(
                    f"executor.batch_memory_bytes ({int(cfg.batch_memory_bytes)}) cannot hold "
                    f"the batch workspace: executor.max_batch ({cfg.max_batch}) rows of "
                    f"executor.row_tokens ({cfg.row_tokens}) tokens take {need} bytes in "
                    f"{str(store.geometry.dtype).removeprefix('torch.')}; raise the first or "
                    f"lower the others")
            rows = BatchRows(store.geometry, cfg.max_batch, cfg.row_tokens, device)
        self.runner = ModelRunner(loaded.model, device=device,
                                  max_step_tokens=max(cfg.step_tokens, cfg.prefill_tokens),
                                  rows=rows)
        self.memo = LogitsMemo()
        self.blocks = BlockManager(store, layout=layout,
                                   budget_bytes=int(cfg.batch_memory_bytes), rows=rows,
                                   memo=self.memo,
                                   on_recompute=self.metrics.recomputed_tokens.inc)
        self.executor = Executor(self.runner, self.blocks, self.table, self.chat,
                                 loaded.tokenizer, cfg, metrics=self.metrics,
                                 threads=loaded.threads)
        self.sessions = SessionView(self.table, store, self.executor, loaded.tokenizer,
                                    self.chat)
        self.started_at: float | None = None
        self.warm_workspace_tokens = cfg.warm_workspace_tokens

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def start(self) -> None:
        if self.blocks.layout == "contiguous":
            self.blocks.workspaces.warm(self.warm_workspace_tokens)
        self.executor.start()
        self.started_at = time.time()
        log.info("engine_started", model=self.loaded.name, dtype=str(self.loaded.dtype),
                 sessions=self.table.count(), kv_layout=self.blocks.layout)

    def stop(self, timeout: float = 10.0) -> None:
        self.executor.stop(timeout)
        self.table.close()
        log.info("engine_stopped")

    def health(self) -> dict[str, Any] | None:
        """The service itself: the model worker thread runs."""
        if not self.executor.running:
            return {"status": "failing", "detail": "the model worker thread is not running"}
        return {"status": "ok", "detail": f"model {self.loaded.name} on {self.loaded.device}"}

    def reload(self, config: object) -> None:
        """Nothing of the engine is reloadable."""

    def submit(self, req: GenerationRequest) -> Job:
        return self.executor.submit(req)

    def ask(self, session: str, text: str | None, *, max_new_tokens: int = 64,
            priority: Priority = Priority.ASK, system: str | None = None,
            timeout: float | None = None) -> GenerationResult:
        """Submit and wait: convenience for scripts and tests."""
        job = self.submit(GenerationRequest(session, text, system, max_new_tokens, priority))
        return job.result(timeout)

    def status(self) -> dict[str, Any]:
        g = self.store.geometry
        ex = self.executor.status()
        mem = ex["memory"]
        mem["step_buffer_bytes"] = self.runner.nbytes()
        return {
            "model": self.loaded.name, "fingerprint": self.loaded.fingerprint[:16],
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "dtype_reason": (self.loaded.dtype_choice.reason if self.loaded.dtype_choice
                             else None),
            "precision_check": (self.loaded.dtype_choice.as_dict() if self.loaded.dtype_choice
                                else None),
            "threads": self.loaded.threads,
            "cpu_native_bf16": cpu_native_bf16(),
            "device": str(self.loaded.device), "load_s": round(self.loaded.load_s, 2),
            "block_tokens": g.block_tokens, "sessions": self.table.count(),
            "workspace_bytes": mem["working_copy_bytes"] + mem["idle_buffer_bytes"],
            "executor": ex,
        }
