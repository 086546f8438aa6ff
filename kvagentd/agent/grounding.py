"""Checks the model's commentary against the measured diagnosis before anyone sees it.

`check(text, diagnosis, evidence, ended=...)` -> `Verdict(ok, reasons)`. The text is withheld
when it
- is empty, or a fragment the model `ended` by itself: under three words that end no sentence
  ("The recent", end of turn: a copy of a turn cut short, it says nothing; text cut by a token
  limit is judged as any text);
- says the machine is normal, healthy, fine or idle while a fault is diagnosed or the ISO zone
  is C or D;
- raises an alarm (alert, alarm, danger, fault, defect, damage, failure, malfunction, broken)
  while the diagnosis is `none` in zone A or B, or calls a low-severity finding critical, an
  emergency or a reason to stop;
- names a fault (or its defect line) other than the diagnosed one and the patterns also seen
  in the window (`secondary`);
- states a number that is not in the evidence the model was given (`evidence`: for a tick,
  the user turns of its session, its first turn's summary included); a number matches when it
  equals one there at the precision it is written with, or
  lies within 2 % of it; a clock time or date is one token and matches only itself.
A phrase preceded by a negation ("no", "not", "without", "nothing" ... within three words) is
not a claim.
The checks are deliberately literal: they cannot tell a paraphrase that is right from one
that is wrong, so they only let through text that restates what was measured.

`constraints(diagnosis, context, current)` steers the model before the check referees it:
what the decoding may not produce for this diagnosis (the words each check above looks for,
spelled out), an opening taken from the diagnosis' own words, and the spans of `context` the
answer may not copy (`engine/constraints.py` applies them per row in the batched step).

`copied(text, context, current)` is a check of its own: text that is, word for word, a piece of
what the model was given before this tick (its session's first turn: profile and summary of
recent state; earlier observations) and not of this tick's observation says nothing about this
tick ("The recent state of pump-1 over 20 measurements from ...", a small model's copy of the
summary's first words, tick after tick). At least `COPY_MIN_WORDS` words: a shorter match is a
common phrase ("in zone A"), not a copy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvagentd.agent.diagnosis.result import FAULT_WORDS
from kvagentd.engine.constraints import Constraints

NORMAL_RE = re.compile(
    r"\b(normal|healthy|idle|inactiv\w*|fine|good condition|in good shape|all good|"
    r"no (?:fault|defect|problem|issue|anomal\w*|damage)s?|nothing (?:wrong|abnormal))\b",
    re.IGNORECASE)
SEVERE_RE = re.compile(r"\b(critical\w*|emergency|danger\w*|immediate\w*|shut ?down|"
                       r"stop the (?:machine|pump|motor))\b", re.IGNORECASE)
ALARM_RE = re.compile(r"\b(alert|alarm|danger\w*|critical|fault\w*|defect\w*|damage\w*|"
                      r"emergency|failure|failing|malfunction\w*|broken|breakdown)\b",
                      re.IGNORECASE)
FAULT_RES = {
    "outer_race": re.compile(r"outer[- ]?(?:race|ring)|\bbpfo\b", re.IGNORECASE),
    "inner_race": re.compile(r"inner[- ]?(?:race|ring)|\bbpfi\b", re.IGNORECASE),
    "ball": re.compile(r"\bballs?\b(?![- ]bearing)|rolling[- ]elements?|\bbsf\b|2xbsf",
                       re.IGNORECASE),
    "cage": re.compile(r"\bcage\b|\bftf\b|\bretainer\b", re.IGNORECASE),
    "imbalance": re.compile(r"\b(?:im|un)balance\w*", re.IGNORECASE),
    "misalignment": re.compile(r"misalign\w*", re.IGNORECASE),
    "looseness": re.compile(r"\bloose(?:ness)?\b", re.IGNORECASE),
}
NEGATION_RE = re.compile(r"\b(no|not|never|without|nor|isn't|is not|none|nothing)\b",
                         re.IGNORECASE)
NUMBER_RE = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?")
# After a number: a line name ("2xBSF", "BPFI-1x": an order up to 10 with "x") is not a number.
_LINE_NAME_RE = re.compile(r"x[A-Za-z]|x\b")
RELATIVE_MATCH = 0.02
COPY_MIN_WORDS = 5
_WORDS_RE = re.compile(r"[^0-9a-z]+")


class Verdict(NamedTuple):
    ok: bool
    reasons: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def _negated(text: str, start: int) -> bool:
    before = text[max(0, start - 40):start].split()[-3:]
    return any(NEGATION_RE.fullmatch(w.strip(",.;:()").lower()) for w in before)


def _claims(pattern: re.Pattern[str], text: str) -> list[str]:
    return [m.group(0) for m in pattern.finditer(text) if not _negated(text, m.start())]


# A clock time or a date is one token, not numbers: "10:00:03" in a turn grounds the time
# 10:00:03, not a reading of 0 or 3 ("RMS 0 mm/s" once passed on a session whose turns held
# ":00" seconds).
CLOCK_RE = re.compile(r"(?<![\w.:])(?:\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2})?Z?)?|"
                      r"\d{1,2}:\d{2}(?::\d{2})?)(?!\w|:\d)")


def clocks(text: str) -> tuple[set[str], str]:
    """The clock times and dates written in `text`, and `text` without them."""
    found = {m.group(0) for m in CLOCK_RE.finditer(text)}
    return found, CLOCK_RE.sub(" ", text) if found else text


def numbers(text: str) -> list[tuple[float, int]]:
    """(value, decimals written) of each number in `text` (clock times and dates aside)."""
    out = []
    body = clocks(text)[1]
    for m in NUMBER_RE.finditer(body):
        s = m.group(0)
        rest = body[m.end():m.end() + 2]
        if _LINE_NAME_RE.match(rest) and (rest[1:2].isalpha() or
                                          ("." not in s and 1 <= abs(float(s)) <= 10)):
            continue
        out.append((float(s), len(s.split(".")[1]) if "." in s else 0))
    return out


def _grounded(value: float, decimals: int, allowed: list[float]) -> bool:
    for e in allowed:
        if round(e, decimals) == round(value, decimals):
            return True
        if e and abs(value - e) <= RELATIVE_MATCH * abs(e):
            return True
    return False


def fragment(text: str) -> bool:
    """Under three words that end no sentence."""
    return len(text.split()) < 3 and not text.rstrip().endswith((".", "!", "?"))


def check(text: str | None, diagnosis: Mapping[str, Any], evidence: str, *,
          ended: bool = False) -> Verdict:
    """Is `text` consistent with `diagnosis` (its dict) and the `evidence` it was given?
    `ended`: the model ended the text itself (not a token limit)."""
    if not text or not text.strip():
        return Verdict(False, ("empty",))
    if ended and fragment(text):
        return Verdict(False, (f"a fragment ({text.strip()!r}), not a sentence",))
    reasons = claims(text, diagnosis)
    allowed = [v for v, _ in numbers(evidence)]
    invented = [v for v, d in numbers(text) if not _grounded(v, d, allowed)]
    if invented:
        reasons.append(f"states {invented[0]:g}, a number not in the evidence")
    times = sorted(clocks(text)[0] - clocks(evidence)[0])
    if times:
        reasons.append(f"states the time {times[0]}, not in the evidence")
    return Verdict(not reasons, tuple(reasons))


def claims(text: str, diagnosis: Mapping[str, Any]) -> list[str]:
    """What `text` says that contradicts `diagnosis`: normal while abnormal, an alarm while
    nothing is diagnosed, an overstated low severity, another fault's name (numbers aside)."""
    fault = str(diagnosis.get("fault", "none"))
    zone = str(diagnosis.get("zone") or "A")
    reasons: list[str] = []
    abnormal = fault != "none" or zone in ("C", "D")
    said_normal = _claims(NORMAL_RE, text)
    if abnormal and said_normal:
        what = fault.replace("_", " ") if fault != "none" else f"zone {zone}"
        reasons.append(f"says {said_normal[0]!r} while the diagnosis is {what}")
    if not abnormal:
        alarms = _claims(ALARM_RE, text)
        if alarms:
            reasons.append(f"raises an alarm ({alarms[0]!r}) while no fault is diagnosed")
    elif str(diagnosis.get("severity", "low")) in ("none", "low"):
        severe = _claims(SEVERE_RE, text)
        if severe:
            reasons.append(f"overstates the severity ({severe[0]!r}) of a "
                           f"{diagnosis.get('severity', 'low')}-severity finding")
    allowed_faults = {fault, *diagnosis.get("secondary", ())}
    for name, pattern in FAULT_RES.items():
        if name in allowed_faults:
            continue
        hits = _claims(pattern, text)
        if hits:
            reasons.append(f"names {name.replace('_', ' ')} ({hits[0]!r}) while the diagnosis "
                           f"is {fault.replace('_', ' ')}")
            break
    return reasons


def _words(text: str) -> str:
    return " " + " ".join(_WORDS_RE.sub(" ", text.lower()).split()) + " "


def copied(text: str, context: str, current: str) -> str | None:
    """The words of `text` (a leading "the" aside) when they are a piece of `context` (what
    the model was given before) and not of `current` (this tick's observation); else None."""
    words = _words(text)
    if words.startswith(" the "):
        words = words[4:]
    body = words.strip()
    if len(body.split()) < COPY_MIN_WORDS:
        return None
    if body in _words(context) and body not in _words(current):
        return body
    return None


_TRAILING_NUMBER_RE = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d*)?$")
NO_REPEAT_TOKENS = 3  # a commentary repeats no 3-gram of its own ids ("no repair, no repair")

# The words the checks above look for, as the decoding constraints spell them out.
ALARM_WORDS = ("alert", "alarm", "alarming", "danger", "dangerous", "critical", "fault",
               "faults", "faulty", "defect", "defects", "defective", "damage", "damaged",
               "emergency", "failure", "failing", "malfunction", "malfunctioning",
               "malfunctions", "broken", "breakdown")
NORMAL_WORDS = ("normal", "normally", "healthy", "idle", "inactive", "fine", "good condition",
                "good shape", "all good", "no fault", "no defect", "no problem", "no issue",
                "no damage", "nothing wrong", "nothing abnormal")
SEVERE_WORDS = ("critical", "emergency", "danger", "dangerous", "immediate", "immediately",
                "shut down", "shutdown", "stop the machine", "stop the pump", "stop the motor")
FAULT_NAMES = {
    "outer_race": ("outer race", "outer-race", "outer ring", "BPFO"),
    "inner_race": ("inner race", "inner-race", "inner ring", "BPFI"),
    "ball": ("ball", "balls", "rolling element", "rolling-element", "BSF", "2xBSF"),
    "cage": ("cage", "FTF", "retainer"),
    "imbalance": ("imbalance", "unbalance", "unbalanced", "imbalanced"),
    "misalignment": ("misalignment", "misaligned"),
    "looseness": ("loose", "looseness"),
}


def opening(diagnosis: Mapping[str, Any]) -> str:
    """The first words of a commentary: the diagnosis' own (\"No fault:\", \"Outer-race
    defect:\", \"Zone C vibration:\" when the level alone is abnormal)."""
    fault = str(diagnosis.get("fault", "none"))
    zone = str(diagnosis.get("zone") or "A")
    if fault == "none":
        return f"Zone {zone} vibration:" if zone in ("C", "D") else "No fault:"
    words = FAULT_WORDS.get(fault, fault.replace("_", " "))
    return words[:1].upper() + words[1:] + ":"


def number_prefixes(evidence: str) -> frozenset[str]:
    """Every prefix of every number written in `evidence` (signs dropped): a number being
    written digit by digit is on its way to one of them while its text is in this set."""
    out: set[str] = set()
    for m in NUMBER_RE.finditer(clocks(evidence)[1]):
        s = m.group(0).lstrip("+-")
        out.update(s[:i] for i in range(1, len(s) + 1))
        if "." not in s:
            out.add(s + ".")  # "0." on its way to "0.95" is as good as "0"
    return frozenset(out)


def constraints(diagnosis: Mapping[str, Any], context: str, current: str,
                evidence: str | None = None) -> Constraints:
    """What the commentary on `diagnosis` may not say (see module docstring); `context`: what
    the model was given before this tick, `current`: this tick's observation, `evidence`:
    every number the model may state (default: both)."""
    if evidence is None:
        evidence = f"{context}\n{current}"
    fault = str(diagnosis.get("fault", "none"))
    zone = str(diagnosis.get("zone") or "A")
    abnormal = fault != "none" or zone in ("C", "D")
    allowed = {fault, *diagnosis.get("secondary", ())}
    banned: list[str] = [w for name, words in FAULT_NAMES.items() if name not in allowed
                         for w in words]
    if abnormal:
        banned += NORMAL_WORDS
        if str(diagnosis.get("severity", "low")) in ("none", "low"):
            banned += SEVERE_WORDS
    else:
        banned += ALARM_WORDS + SEVERE_WORDS
    grounded = number_prefixes(evidence)
    values = [v for v, _ in numbers(evidence)]

    def guard(text: str) -> str | None:
        found = claims(text, diagnosis)
        if found:
            return found[0]
        # A number still being written must be on its way to one of the evidence; one that a
        # token has ended must be one (as the referee judges it): "0" on its way to "0.96"
        # may not be followed by " mm/s".
        m = _TRAILING_NUMBER_RE.search(text)
        if m is not None:
            if m.group(0).lstrip("+-") not in grounded:
                return f"{m.group(0)} begins no number of the evidence"
            text = text[:m.start()]
        for value, decimals in numbers(text):
            if not _grounded(value, decimals, values):
                return f"states {value:g}, a number not in the evidence"
        return None

    return Constraints(opening=opening(diagnosis), banned=tuple(dict.fromkeys(banned)),
                       no_copy=context, allow=current, no_repeat=NO_REPEAT_TOKENS, guard=guard)
