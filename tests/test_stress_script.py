"""scripts/stress.py runs end to end (tiny shapes, interpreter, profiles split over worker processes) and writes its JSON
record. Slow: ~1 min of compiles."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest


def load_stress_script():
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "stress.py")
    spec = importlib.util.spec_from_file_location("stress_script", path)
    stress = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stress  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(stress)
    return stress


@pytest.mark.slow
def test_stress_script_smoke(tmp_path):
    stress = load_stress_script()
    out = tmp_path / "stress.json"
    # 4 batches over 2 workers: each compiles only its profiles (tiny-gqa2 and tiny-mask / tiny-window and tiny-fp8).
    assert stress.main(["--batches", "4", "--mode", "interpret", "--shapes", "tiny", "--workers", "2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["total_mismatches"] == 0
    assert record["complete"] is True  # checkpoints written during the run say False
    assert {op: r["batches"] for op, r in record["results"].items()} == {"decode": 4, "extend": 4, "extend_unified": 4}
    shards = [json.loads((tmp_path / f"stress.json.shard{w}").read_text()) for w in range(2)]
    # The parent's figures are the sum of its workers'; profiles are dealt out (profile index mod 2).
    assert [s["results"]["decode"]["batches"] for s in shards] == [2, 2]
    assert max(s["results"]["extend"]["worst_error_over_tolerance"] for s in shards) == record["results"]["extend"]["worst_error_over_tolerance"]


def test_each_batch_has_its_own_generator_and_shards_cover_the_profiles():
    stress = load_stress_script()
    draws = [stress.batch_rng(0, "extend", i).integers(0, 1 << 30, 4).tolist() for i in range(3)]
    assert draws[1] == stress.batch_rng(0, "extend", 1).integers(0, 1 << 30, 4).tolist()  # same batch, same data
    assert draws[0] != draws[1] != draws[2]
    assert stress.batch_rng(0, "decode", 1).integers(0, 1 << 30, 4).tolist() != draws[1]
    assert sorted({stress.shard_of(i, 10, 4) for i in range(10)}) == [0, 1, 2, 3]


def test_verify_profile_runs_against_the_reference():
    # The several-token decode profile (a random draft tree, sinks, lists shorter than the token count): two batches
    # through the interpreter, no mismatch.
    stress = load_stress_script()
    profile = next(p for p in stress.profiles("tiny") if p.tokens > 1)
    runner = stress.DecodeRunner(profile, stress.SHAPES["tiny"], "interpret", seed=0)
    for i in range(2):
        ok, ratio, reason, case, _ = runner.run(stress.batch_rng(0, "decode", i), i)
        assert ok, (reason, ratio, case)


def test_latent_profile_runs_mla_extend_against_the_reference():
    # A latent cache (V = K's first dims, no V pool): extend through jaxattn.mla.mla_extend_attention (two-stage) and
    # the unified op on V sliced from the pool, two batches through the interpreter, no mismatch.
    stress = load_stress_script()
    profile = next(p for p in stress.profiles("tiny") if p.v_in_k)
    runner = stress.ExtendRunner(profile, stress.SHAPES["tiny"], "interpret", seed=0)
    assert runner.v_pool is None
    for i in range(2):
        results, _ = runner.run(stress.batch_rng(0, "extend", i), i)
        assert [case["op"] for *_, case in results] == ["extend", "extend_unified"]
        for ok, ratio, reason, case in results:
            assert ok, (reason, ratio, case)


def test_draft_words_profile_runs_against_the_reference():
    # The compact tree form on the extend ops (draft words for the two-stage form, the same rows as a mask for the
    # unified one), under a window: two batches through the interpreter, no mismatch.
    stress = load_stress_script()
    profile = stress.Profile("tiny-draft", 4, 2, 32, 32, "float32", draft=True, window=5, sinks=True)
    runner = stress.ExtendRunner(profile, stress.SHAPES["tiny"], "interpret", seed=0)
    for i in range(2):
        results, _ = runner.run(stress.batch_rng(0, "extend", i), i)
        assert [case["op"] for *_, case in results] == ["extend", "extend_unified"]
        for ok, ratio, reason, case in results:
            assert ok, (reason, ratio, case)


def test_pages_profile_runs_against_the_reference():
    # Extend over KV pages (metadata from the page table, the lists' whole-pages promise recorded), with a custom
    # mask: two batches through the interpreter, no mismatch; the pages are whole and never page 0.
    stress = load_stress_script()
    profile = next(p for p in stress.profiles("tiny") if p.page_size > 1)
    runner = stress.ExtendRunner(profile, stress.SHAPES["tiny"], "interpret", seed=0)
    assert runner.slots % profile.page_size == 0
    for i in range(2):
        results, _ = runner.run(stress.batch_rng(0, "extend", i), i)
        for ok, ratio, reason, case in results:
            assert ok, (reason, ratio, case)


def test_profiles_filter_runs_only_the_profiles_it_names(tmp_path, capsys, monkeypatch):
    # --profiles REGEX keeps the profiles whose name it finds (two batches of tiny-mask here); one that finds none is
    # refused. Besides every 100 batches, a run checkpoints once CHECKPOINT_SECONDS have passed since its last save
    # (so a time box ending a slow shard still leaves its figures): at 0 s, after every batch.
    stress = load_stress_script()
    monkeypatch.setattr(stress, "CHECKPOINT_SECONDS", 0)
    out = tmp_path / "stress.json"
    assert stress.main(["--batches", "2", "--ops", "extend", "--mode", "interpret", "--shapes", "tiny",
                        "--profiles", "^tiny-mask$", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [p["name"] for p in record["settings"]["profiles"]] == ["tiny-mask"]
    assert record["results"]["extend"]["batches"] == 2 and record["total_mismatches"] == 0
    printed = capsys.readouterr().out
    assert "extend: 1/2 batches" in printed and "extend: 2/2 batches" in printed, printed
    with pytest.raises(SystemExit):
        stress.main(["--batches", "1", "--mode", "interpret", "--shapes", "tiny", "--profiles", "no-such-profile"])


def test_backend_stress_script_runs_and_catches_a_wrong_backend(tmp_path):
    # scripts/stress_backends.py: TritonBackend (interpreted) against ReferenceBackend, tiny shapes, an extend and a
    # decode batch of two profiles (sinks under a window over pages of 16; a latent MLA pool); then a backend wrong by
    # 1% must be reported.
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "stress_backends.py")
    spec = importlib.util.spec_from_file_location("stress_backends_script", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    out = tmp_path / "s.json"
    args = ["--backend", "triton", "--batches", "2", "--shapes", "tiny", "--profiles", "sinks-window-p16|mla-p16",
            "--json", str(out)]
    assert script.main(args) == 0
    record = json.loads(out.read_text())
    assert record["total_mismatches"] == 0 and record["profiles_left"] == 0
    assert {name: r["batches"] for name, r in record["results"].items()} == {"sinks-window-p16": 2, "mla-p16": 2}
    # A spent time budget still runs each mode of each profile once, then stops.
    assert script.main(args[:3] + ["50", "--seconds", "0"] + args[4:]) == 0
    modes = {p.name: len(p.modes) for p in script.PROFILES}
    record = json.loads(out.read_text())
    assert {name: r["batches"] for name, r in record["results"].items()} == {
        "sinks-window-p16": modes["sinks-window-p16"], "mla-p16": modes["mla-p16"]}
    # Deterministic mode: each batch also checks that a sequence alone, elsewhere in the batch, gives the same bits.
    assert script.main(["--backend", "triton", "--batches", "1", "--shapes", "tiny", "--profiles", "gqa-p16",
                        "--deterministic"]) == 0
    correct_init = script.Runner.__init__

    def off_by_one_percent(self, *a, **kw):
        correct_init(self, *a, **kw)
        step = self.step
        self.step = lambda *x: (lambda o: (o[0] * 1.01, *o[1:]))(step(*x))

    script.Runner.__init__ = off_by_one_percent
    try:
        assert script.main(["--backend", "triton", "--batches", "1", "--shapes", "tiny", "--profiles", "gqa-p1$"]) == 1
    finally:
        script.Runner.__init__ = correct_init

    # The pools after the write: bit for bit but for the slots several tokens wrote (the padding slot, whose value
    # write_kv leaves unspecified on a GPU), so a backend that moves only those passes and one that moves a real
    # token's slot fails.
    def pool_changed_where(pick):
        def init(self, *a, **kw):
            correct_init(self, *a, **kw)
            step = self.step

            def changed(*x):
                o, k_pool, v_pool = step(*x)
                several = ~script.single_writer_slots(np.asarray(x[6].out_cache_loc), k_pool.shape[0])
                slots = pick(np.asarray(x[6].out_cache_loc), several)
                seen.append(len(slots))
                return o, k_pool.at[slots].add(1), v_pool

            self.step = changed
        return init

    for pick, failures in ((lambda loc, several: np.flatnonzero(several), 0),
                           (lambda loc, several: loc[~several[loc]][-1:], 1)):  # a token that alone writes its slot
        seen = []
        script.Runner.__init__ = pool_changed_where(pick)
        try:
            assert script.main(["--backend", "triton", "--batches", "1", "--shapes", "tiny", "--profiles", "gqa-p1$"]) \
                == failures
        finally:
            script.Runner.__init__ = correct_init
        assert all(n == 1 for n in seen) and seen  # each batch changed exactly one slot

    # A run cut after its first profile (the device's time box) keeps that profile's figures in the JSON.
    def cut_after_first(self, profile, *a, **kw):
        if profile.name != "gqa-p1":
            raise KeyboardInterrupt("the time box")
        correct_init(self, profile, *a, **kw)

    script.Runner.__init__ = cut_after_first
    try:
        with pytest.raises(KeyboardInterrupt):
            script.main(["--backend", "triton", "--batches", "1", "--shapes", "tiny", "--profiles", "gqa-p1$|gqa-p16",
                         "--json", str(out)])
    finally:
        script.Runner.__init__ = correct_init
    record = json.loads(out.read_text())
    assert list(record["results"]) == ["gqa-p1"] and record["results"]["gqa-p1"]["batches"] == 1
    assert record["profiles_left"] == 1
