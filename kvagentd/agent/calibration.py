"""The agent's own tick prompts, for the engine's precision check (`engine/precision.py`).

One simulated asset per fault kind (the configured first asset's profile, so the prompts are
this box's), diagnosed by the product's diagnoser at two moments of a growing fault: the first
turn of a session with its observation and the decoding constraints a tick would use. So the
check compares bf16 and fp32 on exactly what the agent asks, not on generic text.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from kvagentd.agent import grounding, prompts
from kvagentd.agent.diagnosis.diagnoser import Diagnoser
from kvagentd.agent.simulator import SimulatedSource
from kvagentd.config import AgentConfig, AssetConfig, FaultConfig
from kvagentd.engine.precision import Calibration

KINDS = ("none", "outer_race", "inner_race", "ball", "cage", "imbalance", "misalignment",
         "looseness")
GROWTH = {"imbalance": 0.25, "misalignment": 0.25, "looseness": 0.4}  # into zone C and D
HOURS = (3.0, 9.0)  # after the fault's onset at hour 1


def calibration_prompts(config: AgentConfig) -> list[Calibration]:
    """16 tick prompts: 8 fault kinds (healthy included) x 2 moments."""
    base = config.assets[0] if config.assets else AssetConfig()
    out = []
    with tempfile.TemporaryDirectory(prefix="kvagentd-calibration-") as tmp:
        for i, kind in enumerate(KINDS):
            a = dataclasses.replace(base, source="simulated", seed=i + 1, baseline_s=0.0,
                                    fault=FaultConfig(kind=kind, onset_s=3600.0,  # type: ignore[arg-type]
                                                      growth_per_hour=GROWTH.get(kind, 1.0)))
            src = SimulatedSource(a, 0.0)
            diagnoser = Diagnoser(a, Path(tmp) / f"{i}.json")
            for h in HOURS:
                t = 1_800_000_000.0 + h * 3600.0
                d = diagnoser.diagnose(src.read_window(h * 3600.0), t).as_dict()
                obs = prompts.observation(t, d)
                recent = f"Recent state of {a.name}: no measurements yet."
                text = prompts.first_turn(a, recent, obs, t)
                out.append(Calibration(prompts.SYSTEM_PROMPT, text,
                                       grounding.constraints(d, text.replace(obs, " "), obs),
                                       config.assessment_max_tokens))
    return out
