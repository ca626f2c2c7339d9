"""examples/tensor_parallel.py: heads sharded over 2 host devices give the unsharded layer's results.

A subprocess, because --xla_force_host_platform_device_count only works before JAX starts its backends.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_heads_match_unsharded(tmp_path):
    record = tmp_path / "tp.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAXATTN_LAUNCH", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "tensor_parallel.py"), "--devices", "2", "--json", str(record)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(record.read_text())
    assert result["devices"] == 2 and result["launch_mode"] == "interpret"
    assert result["local_pool_shape"] == [512, 2, 64]  # each device holds half the KV heads
    for key in ("extend_max_abs_diff", "decode_max_abs_diff", "pool_max_abs_diff"):
        assert result[key] <= 1e-4, (key, result)
    assert "sharded == unsharded within tolerance" in proc.stdout
