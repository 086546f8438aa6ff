"""bench.commentary with a local model directory (`--model-dir`, model.source = hf_dir).

The tiny random-weight Llama proves the plumbing a larger model takes: the same sampled ticks,
the same grounding referee, the same result file, named after the model it ran.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

import bench.commentary
import bench.common
from kvagentd.engine.tiny import tiny_model_dir


@pytest.mark.slow
def test_commentary_bench_runs_a_model_directory(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Path(os.environ.get("KVAGENTD_TEST_CACHE",
                                Path(tempfile.gettempdir()) / "kvagentd-test-cache"))
    model_dir = tiny_model_dir(cache)
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(bench.commentary, "ROOT", tmp_path)

    rc = bench.commentary.main(["--quick", "--samples", "1", "--model-dir", str(model_dir),
                                "--dtype", "float32", "--threads", "1",
                                "--assessment-tokens", "6"])

    assert rc == 0
    out = json.loads((tmp_path / "results" / "commentary.json").read_text())
    figures = out["figures"]
    assert figures["model"] == model_dir.name
    # 3 fault kinds x 1 sampled tick each, every one answered by the model (shown or withheld)
    assert figures["commentaries"] == 3
    assert figures["llm_errors"] == 0
    assert figures["tokens_per_commentary"] > 0
    assert {g["name"] for g in out["goals"]} == {"commentaries withheld",
                                                 "constraints' cost per step / decode step"}
