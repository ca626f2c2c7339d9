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


def bench_arguments(words):
    """(op, {flag: value}) of a `python3 -m jaxattn.bench <op> ...` command's words (after an `env ...` prefix)."""
    start = words.index("jaxattn.bench") + 1
    op, flags = words[start], {}
    for flag, value in zip(words[start + 1:], words[start + 2:]):
        if flag.startswith("--") and not value.startswith("--"):
            flags[flag] = value
    return op, flags


@pytest.mark.parametrize("name", STEP_FILES)
def test_bench_steps_name_real_cases_backends_and_sweep_rows(name):
    # A misspelt case or backend ends the step at once, and a --sweep expression that matches no row of a case
    # times nothing for it: both would spend a device call's box for no figure.
    from jaxattn import bench

    for _, step, command in steps(name):
        commands = [part for part in command.split("&&") if "jaxattn.bench" in part and "plot" not in part.split()]
        for part in commands:
            op, flags = bench_arguments(shlex.split(part))
            if op not in ("decode", "extend"):
                continue
            cases = flags.get("--cases", "").split(",") if "--cases" in flags else [
                case_name for case_name, case in bench.CASES.items() if case.op == op and case.default]
            for case_name in cases:
                assert bench.case_named(case_name) is not None, f"{name}: step {step} names no case {case_name}"
            for backend in flags.get("--backends", "").split(",") if "--backends" in flags else []:
                assert backend in bench.BACKENDS[op], f"{name}: step {step} names no {op} backend {backend}"
            if "--sweep" in flags:
                pattern = re.compile(flags["--sweep"])
                for case_name in cases:
                    labels = [label for label, _ in bench.sweep_variants(op, bench.case_named(case_name))]
                    assert any(pattern.search(label) for label in labels), (
                        f"{name}: step {step}'s --sweep matches no row of {case_name}")


@pytest.mark.parametrize("name", STEP_FILES)
def test_each_list_names_the_card_it_wants(name):
    # gpu_session.sh --by-card runs first the lists whose first line names the card the call got ("h200": the list
    # needs an H200; "any": any Hopper card answers it), so a call is useful whichever card comes.
    with open(os.path.join(QUEUE, name)) as f:
        first = f.readline().strip()
    assert re.fullmatch(r"# card: (h200|any)", first), f"{name}: first line {first!r}, want '# card: h200' or 'any'"


@pytest.mark.parametrize("card,order", [("NVIDIA H200", "a b c"), ("NVIDIA H100 80GB HBM3", "b a c"), (None, "b a c")])
def test_gpu_session_runs_the_lists_for_the_card_it_got_first(tmp_path, card, order):
    # gpu_session.sh --by-card on a stand-in machine: a fake nvidia-smi names the card (none: no GPU seen), the
    # install step is a no-op; steps.txt names the card and the steps ran in the card's order.
    import shutil

    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "gpu_session.sh"), tmp_path / "scripts")
    (tmp_path / "scripts" / "gpu_env.sh").write_text("true\n")
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{card}'\n" if card else "#!/bin/sh\nexit 1\n")
    smi.chmod(0o755)
    lists = {"1_a.steps": "h200", "2_b.steps": "any", "3_c.steps": None}
    for name, tag in lists.items():
        (tmp_path / name).write_text((f"# card: {tag}\n" if tag else "") + f"5 {name[2]} echo {name[2]}\n")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    subprocess.run(["bash", "scripts/gpu_session.sh", "--by-card", *lists, "30"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=60)
    steps_txt = (tmp_path / "out" / "steps.txt").read_text().splitlines()
    assert steps_txt[0].endswith(card or "no GPU seen")
    assert [line.split()[0] for line in steps_txt if " rc=" in line] == order.split()
