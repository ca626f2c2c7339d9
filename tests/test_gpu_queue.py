"""The GPU step lists in benchmarks/gpu_queue/ are well formed before a device call spends time on them: each step
parses as `<seconds> <name> <command>` (what scripts/gpu_session.sh reads), names are unique, the boxes fit the call's
default budget (a step past it would be skipped on the device), the scripts a step runs exist, and a
`gpu_check.sh "<expression>"` step selects GPU tests."""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
QUEUE = os.path.join(ROOT, "benchmarks", "gpu_queue")
STEP_FILES = sorted((name for name in os.listdir(QUEUE) if name.endswith(".steps")),
                    key=lambda name: int(name.split("_")[0]) if name.split("_")[0].isdigit() else -1)


def session_budget() -> int:
    """gpu_session.sh's default TOTAL_SECONDS."""
    with open(os.path.join(ROOT, "scripts", "gpu_session.sh")) as f:
        return int(re.search(r"^total=(\d+)$", f.read(), re.MULTILINE).group(1))


def steps(name):
    rows = []
    with open(os.path.join(QUEUE, name)) as f:
        for line in f:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            seconds, step, command = line.split(maxsplit=2)
            rows.append((int(seconds), step, command.strip()))
    return rows


def test_the_queue_is_numbered_in_run_order():
    assert STEP_FILES and [int(name.split("_")[0]) for name in STEP_FILES] == list(range(1, len(STEP_FILES) + 1))


@pytest.mark.parametrize("name", STEP_FILES)
def test_steps_parse_and_fit_one_call(name):
    rows = steps(name)
    assert rows, f"{name} has no steps"
    names = [step for _, step, _ in rows]
    assert len(set(names)) == len(names), f"{name}: step names repeat"
    assert sum(seconds for seconds, _, _ in rows) <= session_budget(), f"{name}: steps past the budget would be skipped"
    for _, _, command in rows:
        words = shlex.split(command)
        for word in words:
            if re.fullmatch(r"(scripts|benchmarks)/[\w/]+\.(py|sh)", word):
                assert os.path.exists(os.path.join(ROOT, word)), f"{name}: {word} does not exist"
        if words[0] == "python3" and words[1] == "-m":
            assert words[2].startswith("jaxattn.")


@pytest.mark.parametrize("name", STEP_FILES)
def test_gpu_check_selections_select_tests(name):
    for _, step, command in steps(name):
        words = shlex.split(command)
        if words[:2] != ["bash", "scripts/gpu_check.sh"] or len(words) < 3:
            continue
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-k", words[2],
                              "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
        collected = re.search(r"(\d+)/\d+ tests collected", run.stdout)
        assert collected and int(collected.group(1)) > 0, f"{name}: step {step} selects no GPU test\n{run.stdout[-2000:]}"
