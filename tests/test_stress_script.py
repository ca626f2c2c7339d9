"""scripts/stress.py runs end to end (tiny shapes, interpreter) and writes its JSON record. Slow: ~1 min of compiles."""

import importlib.util
import json
import os
import sys

import pytest


@pytest.mark.slow
def test_stress_script_smoke(tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "stress.py")
    spec = importlib.util.spec_from_file_location("stress_script", path)
    stress = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stress  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(stress)
    out = tmp_path / "stress.json"
    assert stress.main(["--batches", "3", "--mode", "interpret", "--shapes", "tiny", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["total_mismatches"] == 0
    assert record["complete"] is True  # checkpoints written during the run say False
    assert {op: r["batches"] for op, r in record["results"].items()} == {"decode": 3, "extend": 3, "extend_unified": 3}
