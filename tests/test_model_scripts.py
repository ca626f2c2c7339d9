"""examples/generate.py and scripts/compare_transformers.py on a tiny random checkpoint (CPU, reference backend)."""

import json
import os
import subprocess
import sys

from jaxattn.models.testing import write_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generate_serves_a_checkpoint_and_matches_dense(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import generate

    write_random_checkpoint(tmp_path / "model", "qwen2", seed=5)
    record = tmp_path / "record.json"
    assert generate.main(["--model", str(tmp_path / "model"), "--prompt-ids", "5,6,7", "--prompt-ids", "8,9,10,11,12",
                          "--system-ids", "20,21,22,23,24,25,26,27", "--max-new-tokens", "4", "--ignore-eos", "--check",
                          "--json", str(record)]) == 0
    out = json.loads(record.read_text())
    assert [len(g) for g in out["generated"]] == [4, 4]
    assert out["counts"]["reused_tokens"] == 16  # both prompts reuse the 8 cached system-prompt tokens
    assert out["max_abs_logit_diff_vs_dense"] < 1e-4


def test_compare_script_imports_and_parses_without_torch():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_transformers.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--bench" in done.stdout and "--dry-run" in done.stdout
