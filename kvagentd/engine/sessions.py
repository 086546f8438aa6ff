"""Sessions: token ids (the source of truth) plus block keys, persisted in SQLite.

History is never re-templated or re-tokenized: a request chat-templates only its new turn and
appends those ids. A new session starts with the chat-templated system prompt, identical for
equal prompts, so its full blocks are shared between sessions.

A `SessionGuard` (the fleet's session hand-over, when a remote store is configured) is asked
before a turn writes a session (`check_writable`: another box may hold it now) and told of
every save (to publish it).
"""

from __future__ import annotations

import re
import contextlib
import errno
import os
import sqlite3
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

SESSION_ID_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
KEY_BYTES = 16

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id          TEXT PRIMARY KEY,
    token_ids   BLOB NOT NULL,
    block_keys  BLOB NOT NULL,
    created     REAL NOT NULL,
    last_used   REAL NOT NULL,
    turns       INTEGER NOT NULL,
    owner       INTEGER
)
"""
_COLUMNS = "id, token_ids, block_keys, created, last_used, turns, owner"


def valid_session_id(session_id: str) -> bool:
    return bool(SESSION_ID_RE.fullmatch(session_id))


@dataclass(slots=True)
class Session:
    id: str
    token_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    turns: int = 0
    owner: int | None = None  # uid of the API caller that created it; None: the daemon itself

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "tokens": len(self.token_ids), "blocks": len(self.block_keys),
                "turns": self.turns, "created": self.created, "last_used": self.last_used,
                "owner_uid": self.owner}


class SessionFenced(RuntimeError):
    """Another box holds this session now (it was handed over): this box must not write it."""


class SessionGuard(Protocol):
    """What the session table asks of the fleet before and after a session is written."""

    def check_writable(self, session: Session) -> None:
        """Raise `SessionFenced` when this box may no longer write `session` (a bounded,
        fast check; a remote that cannot be asked does not block the write)."""
        ...

    def saved(self, session: Session) -> None:
        """`session` was saved: publish it. Never waits for I/O, never raises."""
        ...


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as the session table (and a published session) stores them: uint32."""
    return _pack_ids(ids)


def unpack_ids(blob: bytes) -> list[int]:
    return _unpack_ids(blob)


def _pack_ids(ids: Sequence[int]) -> bytes:
    a = array("I", ids)
    if a.itemsize != 4:  # pragma: no cover - every platform kvagentd runs on has 4-byte "I"
        raise RuntimeError("array('I') is not 32-bit here")
    return a.tobytes()


def _unpack_ids(blob: bytes) -> list[int]:
    a = array("I")
    a.frombytes(blob)
    return a.tolist()


class SessionStore:
    """SQLite table of sessions in `state_dir/sessions.sqlite3`. Thread-safe.

    A session's owner is written once, when its row is created (`create`, or the first `save`);
    later saves never change it.
    """

    def __init__(self, state_dir: Path, guard: SessionGuard | None = None) -> None:
        self.guard = guard
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(state_dir) / "sessions.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NOTE: FULL: an answered ask's session survives a power cut (0.25 ms a save here)
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(sessions)")}
        if "owner" not in columns:  # a table written before sessions had owners
            self._db.execute("ALTER TABLE sessions ADD COLUMN owner INTEGER")

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM sessions WHERE id = ?",
                                   (session_id,)).fetchone()
        return self._row(row) if row else None

    def create(self, s: Session) -> bool:
        """Insert `s` unless a session with its id exists; True when this call created it."""
        with self._lock, self._writing():
            cur = self._db.execute(
                f"INSERT INTO sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO NOTHING", self._values(s))
            return cur.rowcount == 1

    def check_writable(self, s: Session) -> None:
        """Raise `SessionFenced` when another box holds `s` now (see `SessionGuard`)."""
        if self.guard is not None:
            self.guard.check_writable(s)

    def save(self, s: Session) -> None:
        with self._lock, self._writing():
            self._db.execute(
                f"INSERT INTO sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET "
                "token_ids = excluded.token_ids, block_keys = excluded.block_keys, "
                "last_used = excluded.last_used, turns = excluded.turns", self._values(s))
        if self.guard is not None:
            self.guard.saved(s)

    def replace(self, s: Session) -> None:
        """Store `s` whole (its owner included), replacing a session of the same id: a
        session handed over from another box. The guard is not told (it published it)."""
        with self._lock, self._writing():
            self._db.execute(
                f"INSERT OR REPLACE INTO sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                self._values(s))

    def list(self) -> list[Session]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM sessions ORDER BY last_used DESC").fetchall()
        return [self._row(r) for r in rows]

    def drop(self, session_id: str) -> Session | None:
        with self._lock, self._writing():
            row = self._db.execute(f"SELECT {_COLUMNS} FROM sessions WHERE id = ?",
                                   (session_id,)).fetchone()
            if row:
                self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        return self._row(row) if row else None

    def discard_empty(self, session_id: str) -> bool:
        """Delete the session if it holds no tokens (a first turn that never ran)."""
        with self._lock, self._writing():
            cur = self._db.execute("DELETE FROM sessions WHERE id = ? AND length(token_ids) = 0",
                                   (session_id,))
            return cur.rowcount == 1

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM sessions").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """SQLite's full, read-only and I/O errors as the OSError they are (ENOSPC, EROFS,
        EIO) naming the file, so that callers and the control API tell a full disk from a
        bug (507, not 500); the transaction is rolled back, nothing half-written stays."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            name = getattr(exc, "sqlite_errorname", "")
            code = (errno.ENOSPC if name == "SQLITE_FULL"
                    else errno.EROFS if name.startswith("SQLITE_READONLY")
                    else errno.EIO if name.startswith("SQLITE_IOERR") else None)
            if code is None:
                raise
            raise OSError(code, f"{os.strerror(code)} ({exc})", str(self.path)) from exc

    @staticmethod
    def _values(s: Session) -> tuple[Any, ...]:
        return (s.id, _pack_ids(s.token_ids), b"".join(s.block_keys), s.created, s.last_used,
                s.turns, s.owner)

    @staticmethod
    def _row(row: tuple[Any, ...]) -> Session:
        sid, ids, keys, created, last_used, turns, owner = row
        return Session(sid, _unpack_ids(ids),
                       [bytes(keys[i:i + KEY_BYTES]) for i in range(0, len(keys), KEY_BYTES)],
                       created, last_used, turns, owner)


class ChatFormat:
    """Chat-template pieces as token ids, derived from the tokenizer's own template.

    `first_turn` = system (or the template's default) + user turn + assistant header;
    `next_turn` = user turn + assistant header only; `close_turn` = what ends an assistant
    turn after the generated ids (e.g. "<|im_end|>\\n"), minus an end token already generated;
    `unanswered` = a prompt without its assistant header (a turn cut before its answer).
    """

    _MARK = "\u2063kvagentd\u2063"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = self._stop_ids(tokenizer)
        sys_msg = [{"role": "system", "content": "s"}]
        prefix = self._render(sys_msg, False)
        full = self._render(sys_msg + [{"role": "user", "content": self._MARK}], True)
        if not full.startswith(prefix):
            raise ValueError("chat template does not render turns incrementally")
        self._turn_before, self._turn_after = full[len(prefix):].split(self._MARK)
        asst = self._render(sys_msg + [{"role": "assistant", "content": self._MARK}], False)
        self._close_text = asst.split(self._MARK)[1]
        user = sys_msg + [{"role": "user", "content": self._MARK}]
        ended = self._render(user, False)
        self._header = (self._encode(full[len(ended):]) if full.startswith(ended)
                        and len(full) > len(ended) else [])

    def first_turn(self, system: str | None, text: str) -> list[int]:
        messages = [{"role": "system", "content": system}] if system else []
        return self._encode(self._render(messages + [{"role": "user", "content": text}], True))

    def next_turn(self, text: str) -> list[int]:
        return self._encode(self._turn_before + text + self._turn_after)

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        text = self._close_text
        if generated and generated[-1] in self.stop_ids:
            end = self.tokenizer.convert_ids_to_tokens(int(generated[-1]))
            if isinstance(end, str) and text.startswith(end):
                text = text[len(end):]
        return self._encode(text) if text else []

    def unanswered(self, prompt: Sequence[int]) -> list[int]:
        """`prompt` as a user turn left unanswered: without its trailing assistant header, so
        that the next turn follows it as another user turn. Ids that do not end with the header
        (a session's own ids, continued without a new turn) stay as they are; with a template
        whose header is not known, the turn is closed by an empty answer."""
        h = self._header
        if not h:
            return list(prompt) + self.close_turn([])
        if len(prompt) >= len(h) and list(prompt[len(prompt) - len(h):]) == h:
            return list(prompt[:len(prompt) - len(h)])
        return list(prompt)

    def turns(self, text: str) -> list[dict[str, str]] | None:
        """A session's decoded text as its turns, `[{"role", "text"}]` (an answer still open
        at the end included), read with the markers the template writes around each role's
        content; None when the template's markers cannot be learned (show the raw text)."""
        marks = self._markers()
        if marks is None:
            return None
        starts, end = marks
        out: list[dict[str, str]] = []
        at = 0
        while True:
            found = [(text.find(b, at), role, b) for role, b in starts.items() if b]
            found = [f for f in found if f[0] >= 0]
            if not found:
                break
            i, role, b = min(found)
            body_at = i + len(b)
            j = text.find(end, body_at)
            out.append({"role": role, "text": text[body_at: j if j >= 0 else len(text)]})
            if j < 0:
                break
            at = j + len(end)
        return out

    def _markers(self) -> tuple[dict[str, str], str] | None:
        """(text before each role's content, text after any content), learned by rendering
        one turn per role with marks in place of the contents."""
        m1, m2, m3 = (f"{self._MARK}{i}{self._MARK}" for i in (1, 2, 3))
        try:
            full = self._render([{"role": "system", "content": m1},
                                 {"role": "user", "content": m2},
                                 {"role": "assistant", "content": m3}], False)
        except Exception:  # noqa: BLE001 - a template that refuses: no turns, the raw text
            return None
        if not all(m in full for m in (m1, m2, m3)):
            return None
        p0, rest = full.split(m1)
        p1, rest = rest.split(m2)
        p2, p3 = rest.split(m3)
        end = p3
        if not end or not p1.startswith(end) or not p2.startswith(end):
            return None
        return {"system": p0, "user": p1[len(end):], "assistant": p2[len(end):]}, end

    def _render(self, messages: list[dict[str, str]], gen_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=gen_prompt))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _stop_ids(tokenizer: Any) -> frozenset[int]:
        ids = set()
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return frozenset(ids)
