"""The commentary check: what is withheld and what passes."""

from __future__ import annotations

import pytest

from kvagentd.agent import grounding
from kvagentd.agent.grounding import check, copied, fragment
from kvagentd.agent.prompts import diagnosis_text

OUTER = {"fault": "outer_race", "severity": "low", "confidence": 0.9, "zone": "A",
         "rms_mm_s": 0.42, "kurtosis": 7.5, "summary": "s", "action": "plan a bearing change",
         "secondary": [], "ratios": {"BPFO": 8.1},
         "lines": [{"line": "BPFO", "found_hz": 106.0, "ratio": 8.1, "threshold": 3.6,
                    "significant": True}, {"line": "2xBPFO", "found_hz": 212.0, "ratio": 5.2,
                                           "threshold": 3.2, "significant": True}],
         "trend": {}}
NONE = {**OUTER, "fault": "none", "severity": "none", "lines": []}
ZONE_D = {**NONE, "zone": "D"}
EVIDENCE = diagnosis_text(OUTER)


@pytest.mark.parametrize("text,diagnosis,bad", [
    ("The pump-1 is currently in a state of inactivity.", OUTER, "inactivity"),
    ('Condition: "Normal". Recommendation: "Condition"', OUTER, "Normal"),
    ("Machine healthy, no action.", ZONE_D, "healthy"),
    ("Inner race damage, replace the bearing.", OUTER, "inner race"),
    ("Imbalance: balance the rotor.", OUTER, "imbalance"),
    ("Outer-race defect, BPFO 51.8x the floor.", OUTER, "51.8"),
    ("pump-1 is in a state of emergency", NONE, "emergency"),
    ("Outer race defect: stop the machine immediately.", OUTER, "overstates"),
    ("Alert: outer race defect.", NONE, "outer race"),
    ("The machine is malfunctioning.", NONE, "malfunctioning"),  # the embedded model, make run
    ("pump-1 is broken down", NONE, "broken"),
    ("", OUTER, "empty"),
])
def test_contradictions_are_withheld(text, diagnosis, bad):
    v = check(text, diagnosis, EVIDENCE)
    assert not v.ok and bad.lower() in v.reason.lower(), v


@pytest.mark.parametrize("text,diagnosis", [
    ("Outer-race defect, BPFO line 8.1x the floor: plan a bearing replacement.", OUTER),
    ("Outer race damage (BPFO 8.1x, 2xBPFO 5.2x); not normal: plan a bearing change.", OUTER),
    ("No fault: RMS 0.42 mm/s in zone A; no action.", NONE),
    ("Normal operation, no imbalance and no misalignment.", NONE),
    ("Nothing is broken: RMS 0.42 mm/s in zone A.", NONE),
    ("Outer race defect: the bearing is malfunctioning, plan a bearing change.", OUTER),
])
def test_restatements_pass(text, diagnosis):
    assert check(text, diagnosis, diagnosis_text(diagnosis)).ok


def test_secondary_patterns_may_be_named():
    d = {**OUTER, "zone": "C", "secondary": ["imbalance"]}
    assert check("Outer race defect with imbalance.", d, EVIDENCE).ok


@pytest.mark.parametrize("text,is_fragment", [
    ("The recent", True), ("Outer", True), ("No fault.", False),  # short, but a sentence
    ("Zone A, no action", False),
])
def test_fragments(text, is_fragment):
    assert fragment(text) is is_fragment
    # withheld only where the model ended the text itself, not a token limit
    assert check(text, NONE, EVIDENCE, ended=True).ok is not is_fragment
    assert "fragment" not in check(text, NONE, EVIDENCE).reason


SUMMARY = ("Recent state of pump-1 over 20 measurements from 2026-12-02T08:54:30 to "
           "2026-12-02T08:55:27: RMS 0.90-1.04 mm/s (last 0.97); zones A 20; diagnoses none 20.")
OBS = "08:56:27 RMS 0.96 mm/s, zone A, kurtosis 2.9, no fault pattern."


@pytest.mark.parametrize("text, copy", [
    # the model's copy of the summary's first words, cut by its token limit (the field's case)
    ("The recent state of pump-1 over 20 measurements from 2026-12-02", True),
    ("recent state of pump-1 over 20 measurements", True),
    # this tick's own observation, restated: a commentary
    ("RMS 0.96 mm/s, zone A, kurtosis 2.9, no fault pattern.", False),
    ("Zone A, no fault pattern.", False),  # under five words: a common phrase
    ("Vibration of pump-1 stays low in zone A over 20 measurements.", False),
])
def test_a_copy_of_what_the_model_was_given_is_found(text, copy):
    got = copied(text, f"Pump-1 is a centrifugal pump. Date 2026-12-02 (UTC).\n{SUMMARY}", OBS)
    assert (got is not None) is copy


def test_constraints_steer_each_diagnosis_toward_what_the_check_accepts() -> None:
    """The decoding constraints spell out the check's own words: a healthy asset's commentary
    opens "No fault:" and may not raise an alarm or name a fault; a faulty one opens with its
    fault, may name it but not call the machine normal, name another fault or overstate a
    low severity. The guard refuses exactly what `claims` finds, and a number that is on its
    way to none of the evidence."""
    healthy = {"fault": "none", "zone": "A"}
    c = grounding.constraints(healthy, "Asset p: 15 kW.", "No fault; RMS 0.95 mm/s, zone A.")
    assert c.opening == "No fault:" and {"fault", "BPFO", "critical"} <= set(c.banned)
    assert c.guard is not None
    assert c.guard("No fault: RMS 0.95 mm/s in zone A; no action.") is None
    assert "alarm" in (c.guard("No fault: RMS 0.95 mm/s but the bearing is damaged") or "")
    assert c.guard("No fault: RMS 0.9") is None  # on its way to 0.95
    assert "evidence" in (c.guard("No fault: RMS 0.97") or "")
    assert c.guard("rated 15 kW") is None and c.guard("rated 150") is not None
    outer = {"fault": "outer_race", "zone": "A", "severity": "low", "secondary": ["cage"]}
    c = grounding.constraints(outer, "", "BPFO line 8.1x the noise floor")
    assert c.opening == "Outer-race defect:"
    assert "BPFO" not in c.banned and "FTF" not in c.banned and "BPFI" in c.banned
    assert {"normal", "healthy", "critical"} <= set(c.banned) and "defect" not in c.banned
    assert c.guard is not None and "names inner race" in (c.guard("an inner-race spall") or "")
    high = {"fault": "imbalance", "zone": "D", "severity": "high"}
    c = grounding.constraints(high, "", "")
    assert "critical" not in c.banned and c.opening == "Imbalance:"
    assert grounding.opening({"fault": "none", "zone": "C"}) == "Zone C vibration:"


def test_a_number_ended_short_of_the_evidence_is_refused_and_withheld() -> None:
    """"0" is on its way to "0.95", but a token that ends it there states 0: the guard refuses
    it and the referee withholds it, even when the session's turns hold clock times whose
    seconds read ":00" (a time is one token, not the numbers 10, 0 and 3)."""
    healthy = {"fault": "none", "zone": "A"}
    context = "10:00:00. No fault; RMS 0.93 mm/s, zone A.\nSummary 2026-12-07 10:00 to 10:05."
    current = "10:00:03. No fault; RMS 0.95 mm/s, zone A."
    c = grounding.constraints(healthy, context, current)
    assert c.guard is not None
    assert c.guard("No fault: RMS 0") is None and c.guard("No fault: RMS 0.") is None
    assert "states 0" in (c.guard("No fault: RMS 0mm") or "")
    assert "states 0" in (c.guard("No fault: RMS 0 mm/s") or "")
    assert "states 0" in (c.guard("No fault: RMS 0. mm/s") or "")
    assert c.guard("No fault: RMS 0.95 mm/s in zone A.") is None
    evidence = f"{context}\n{current}"
    for text in ("No fault: RMS 0mm/s in zone A; no action.",
                 "No fault: RMS 3 mm/s in zone A; no action."):
        v = grounding.check(text, healthy, evidence)
        assert not v.ok and "a number not in the evidence" in v.reasons[0], text
    assert grounding.check("No fault at 10:00:03: RMS 0.95 mm/s.", healthy, evidence).ok
    v = grounding.check("No fault at 10:07:00: RMS 0.95 mm/s.", healthy, evidence)
    assert not v.ok and "the time 10:07:00" in v.reasons[0]
    assert grounding.numbers(evidence) == [(0.93, 2), (0.95, 2)]
    # "2x" names a line (2xBSF, the 1x line); "0x" names none: it is the number 0
    assert "states 0" in (c.guard("No fault: RMS 0x 0.95") or "")
    assert grounding.numbers("the 1x line, 2xBSF, 0x") == [(0.0, 0)]
    # a line name after a clock time is read where it stands, not shifted by the time
    assert grounding.numbers("10:00:03. the 2x line, RMS 0.95") == [(0.95, 2)]
