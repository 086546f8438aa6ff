"""Fixtures of the agent tests: a fake executor with the engine's API, a manual scheduler clock."""

from __future__ import annotations

import threading

import pytest

from kvagentd.config import AgentConfig, AssetConfig
from kvagentd.engine.executor import GenerationRequest, QueueFull
from kvagentd.engine.job import OnCut
from kvagentd.engine.job import GenerationResult


class FakeJob:
    def __init__(self, res: GenerationResult | BaseException) -> None:
        self._res = res

    def result(self, timeout: float | None = None) -> GenerationResult:
        if isinstance(self._res, BaseException):
            raise self._res
        return self._res

    def cancel(self) -> None:
        pass

    def stream(self):
        yield self.result().text


class FakeExecutor:
    """Counts tokens as whitespace words; a session is the concatenation of its turns."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.sessions: dict[str, int] = {}
        self.fail_next: BaseException | None = None
        self.full = False
        self.answer = "Condition normal, no action needed."
        self.finish_reason = "stop"
        self.lock = threading.Lock()
        self.beats: list[int] = []  # sizes of the submit_all calls
        self.rewinds: list[tuple[str, int]] = []

    def submit(self, req: GenerationRequest) -> FakeJob:
        if self.full:
            raise QueueFull()
        with self.lock:
            self.requests.append(req)
            if self.fail_next is not None:
                exc, self.fail_next = self.fail_next, None
                return FakeJob(exc)
            prior = self.sessions.get(req.session)
            start = prior or 0
            if prior is None:
                prior = len((req.system or "").split())
            prompt = prior + len(req.text.split())
            answer = self.answer
            new = len(answer.split())
            # as the engine keeps the turn: answered, or cut and kept as its request says
            on_cut = (req.on_cut if self.finish_reason in ("deadline", "cancelled")
                      else OnCut.ANSWER)
            held = {OnCut.ANSWER: prompt + new if new else 0, OnCut.NOTHING: 0,
                    OnCut.PROMPT: prompt - 1}[on_cut]  # a prompt less its assistant header
            if held:
                self.sessions[req.session] = held
        return FakeJob(GenerationResult(req.session, answer, new_tokens=new, prompt_tokens=prompt,
                                        reused_tokens=prior, recomputed_tokens=prompt - prior,
                                        finish_reason=self.finish_reason, saved=held > 0,
                                        session_tokens=held, turn_start=start,
                                        unanswered_tokens=prompt - 1))

    def rewind(self, session: str, tokens: int) -> bool:
        with self.lock:
            if self.sessions.get(session, 0) <= tokens:
                return False
            self.sessions[session] = tokens
            self.rewinds.append((session, tokens))
            return True

    def submit_all(self, reqs: list[GenerationRequest]) -> list[FakeJob | QueueFull]:
        self.beats.append(len(reqs))
        out: list[FakeJob | QueueFull] = []
        for req in reqs:
            try:
                out.append(self.submit(req))
            except QueueFull as exc:
                out.append(exc)
        return out


@pytest.fixture
def fake_executor() -> FakeExecutor:
    return FakeExecutor()


class ManualClock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def agent_config(**kw) -> AgentConfig:
    assets = kw.pop("assets", (AssetConfig(),))
    return AgentConfig(assets=tuple(assets), **kw)


@pytest.fixture
def scheduler():
    from apscheduler.schedulers.background import BackgroundScheduler

    s = BackgroundScheduler(timezone="UTC")
    s.start(paused=True)
    yield s
    s.shutdown(wait=False)
