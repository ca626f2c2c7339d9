"""The benchmark machinery on tiny cases (CPU: the kernels run in Triton's interpreter, each timed once)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import bench, testing
from jaxattn.bench import cli, report

TINY = [
    bench.Case("TD", "decode", batch=2, prefix=40, new=1, q_heads=4, kv_heads=2, head_dim=128),
    bench.Case("TE", "extend", batch=2, prefix=24, new=16, q_heads=4, kv_heads=2, head_dim=128),
]


@pytest.fixture
def one_call(monkeypatch):
    """time_calls stand-in: one call, synchronised, a fixed 1 ms; the outputs are kept for checking."""
    outputs = []

    def timed_once(fn, sync, **_):
        out = fn()
        sync(out)
        outputs.append(np.asarray(out, np.float32))
        return 1.0

    monkeypatch.setattr(cli, "time_calls", timed_once)  # where run looks it up
    return outputs


def test_run_table_json_and_plot(one_call, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXATTN_COMMIT", "abc1234")
    rows = []
    for case in TINY:
        peer = "flashinfer" if case.op == "decode" else "cudnn"
        rows += bench.run(case.op, [case], backends=["jaxattn", peer, "reference"], log=lambda _: None, progress=case.op == "extend")
        # the kernel path through the interpreter agrees with the jnp reference
        got, want = one_call[-2:]
        assert got.shape == (case.batch * case.new, case.q_heads, case.dv)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    # FlashInfer is not installed here and cuDNN takes no cached prefix: both are skipped, never fatal.
    assert [(r["case"], r["backend"]) for r in rows] == [("TD", "jaxattn"), ("TD", "reference"), ("TE", "jaxattn"), ("TE", "reference")]
    for row in rows:
        case = next(c for c in TINY if c.name == row["case"])
        assert row["median_ms"] == 1.0 and row["fraction_of_floor"] == round(case.floor_ms(), 3)
        assert set(row) == {"op", "case", "backend", "median_ms", "floor_ms", "fraction_of_floor", "device", "commit", "date"}
    table = bench.markdown_table(rows)
    assert table.splitlines()[0].startswith("| backend | TD (floor") and "| jaxattn | 1.000 ms" in table

    pytest.importorskip("matplotlib")
    record = tmp_path / "rows.json"
    record.write_text(json.dumps(rows))
    png = tmp_path / "plot.png"
    assert bench.main(["plot", str(record), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_interleave_the_backends_and_report_their_spread(monkeypatch):
    # Round r times every backend of a case once before round r + 1 starts; a row's figure is its rounds' median.
    order, times = [], iter([3.0, 1.0, 1.0, 2.0, 2.0, 3.0])
    monkeypatch.setattr(cli, "time_calls", lambda fn, sync, **_: (order.append(fn), next(times))[1])
    makers = {name: (lambda inp, name=name: name, None) for name in ("a", "b")}
    monkeypatch.setitem(cli.BACKENDS, "decode", makers)
    rows = bench.run("decode", [TINY[0]], rounds=3, log=lambda _: None, progress=False)
    assert order == ["a", "b"] * 3
    a, b = rows
    assert (a["backend"], a["round_ms"], a["median_ms"], a["spread"]) == ("a", [3.0, 1.0, 2.0], 2.0, 1.0)
    assert (b["backend"], b["round_ms"], b["median_ms"], b["spread"]) == ("b", [1.0, 2.0, 3.0], 2.0, 1.0)
    with pytest.raises(ValueError, match="rounds"):
        bench.run("decode", [TINY[0]], rounds=0, log=lambda _: None, progress=False)


def test_page_sizes_share_the_rounds_and_paged_rows_get_a_paired_ratio(monkeypatch):
    # Round r times every backend at every page size of a case before round r + 1; a paged row's vs_page_1 is the
    # median of its per-round ratios to the same backend's page-1 round, not the ratio of the medians.
    order = []
    times = {("a", 1): [1.0, 2.0, 4.0], ("a", 16): [1.1, 1.8, 4.8], ("b", 1): [1.0] * 3, ("b", 16): [1.0] * 3}

    def timed(fn, sync, **_):
        order.append(fn)
        return times[fn].pop(0)

    monkeypatch.setattr(cli, "time_calls", timed)
    monkeypatch.setattr(cli, "make_inputs", lambda case: case.page_size)
    makers = {name: (lambda page_size, name=name: (name, page_size), None) for name in ("a", "b")}
    monkeypatch.setitem(cli.BACKENDS, "decode", makers)
    rows = bench.run("decode", [TINY[0]], rounds=3, page_sizes=(1, 16), log=lambda _: None, progress=False)
    assert order == [("a", 1), ("b", 1), ("a", 16), ("b", 16)] * 3
    by_name = {(r["case"], r["backend"]): r for r in rows}
    assert list(by_name) == [("TD", "a"), ("TD", "b"), ("TD-P16", "a"), ("TD-P16", "b")]
    assert "vs_page_1" not in by_name["TD", "a"]
    # a: per round 1.1 / 1.0, 1.8 / 2.0, 4.8 / 4.0 -> median 1.1, where the medians' ratio is 1.8 / 2.0 = 0.9.
    assert by_name["TD-P16", "a"]["vs_page_1"] == 1.1 and by_name["TD-P16", "a"]["median_ms"] == 1.8
    assert by_name["TD-P16", "b"]["vs_page_1"] == 1.0


def test_floors():
    # decode: K and V bytes once; extend: the causal FLOPs (the anchors' numbers)
    assert bench.CASES["D1"].floor_ms() == pytest.approx(64 * 4096 * 8 * 256 * 2 / 4.3e12 * 1e3)
    assert bench.CASES["MLA"].floor_ms() == pytest.approx(64 * 4096 * 576 * 2 / 4.3e12 * 1e3)
    assert bench.CASES["MHA"].floor_ms() == pytest.approx(16 * 4096 * 32 * 256 * 2 / 4.3e12 * 1e3)
    assert bench.CASES["E2"].floor_ms() == pytest.approx(4 * 32 * 128 * 4096 * (4096 + 1) / 2 * 4 / 790e12 * 1e3)
    # Dqk != Dv: QK^T costs 2 * Dqk and PV 2 * Dv FLOPs per visible pair and head
    t192 = bench.CASES["T192"]
    pairs = t192.new * (t192.prefix + (t192.new + 1) / 2) * t192.batch
    assert t192.floor_ms() == pytest.approx(2 * 16 * (192 + 128) * pairs / 790e12 * 1e3)


def test_floors_follow_the_device():
    # Floors divide by the running GPU's measured rates; a GPU without figures gets the H200's and the note says so.
    slower = bench.Ceilings(copy_bytes_per_s=2.15e12, bf16_matmul_flops=395e12)
    for name in ("D1", "E2"):
        assert bench.CASES[name].floor_ms(slower) == pytest.approx(2 * bench.CASES[name].floor_ms())
    assert bench.ceilings_for("cpu") == ("NVIDIA H200", bench.CEILINGS["NVIDIA H200"])
    assert bench.ceilings_for("NVIDIA H200")[1].copy_bytes_per_s == 4.3e12
    assert bench.floor_note("decode", "cpu").endswith("at 4.3 TB/s, NVIDIA H200's)")
    assert bench.floor_note("extend", "NVIDIA H200") == "extend: % of the matmul floor (bf16 at 790 TFLOP/s)"
    h100 = "NVIDIA H100 80GB HBM3"  # the device tool's other card, as JAX names it
    assert bench.ceilings_for(h100) == (h100, bench.CEILINGS[h100])
    assert bench.floor_note("extend", h100) == "extend: % of the matmul floor (bf16 at 670 TFLOP/s)"


def test_mla_tuning_cases_run_only_by_name(monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "run", lambda op, cases, *a, **k: ran.append(cases) or [])
    monkeypatch.setattr(cli, "commit", lambda: "abc1234")
    assert bench.main(["extend", "--no-progress"]) == 0
    assert bench.main(["extend", "--cases", "T64,T576", "--no-progress"]) == 0
    assert ran == [["E1", "E2", "E3", "E1-W1024", "E1-CAP50", "E1-W1024-CAP50", "E1-SINKS", "E2-NC", "E1-XAI-CAP30",
                    "V-TREE64", "V-TREE64-W128", "E1-FP8", "E3-FP8", "T64", "T256", "T192"], ["T64", "T576"]]


def test_tree_verify_case(one_call):
    # A verify step under a random draft tree: the floor counts the prefix and each draft's ancestors; jaxattn's
    # two-stage and unified rows (the custom mask through the Triton kernels, interpreted here) agree with the reference.
    mask = bench.cases.draft_tree(9)
    assert mask.diagonal().all() and not np.triu(mask, 1).any()  # each token sees itself, never a later token
    for j in range(1, 9):  # a draft sees its parent's set plus itself (a root: itself only)
        ancestors = mask[j] & ~np.eye(9, dtype=bool)[j]
        assert not ancestors.any() or any((ancestors == mask[p]).all() for p in range(j))
    case = bench.Case("TV", "extend", batch=2, prefix=20, new=9, q_heads=4, kv_heads=2, head_dim=64, tree=True)
    assert case.visible_pairs() == 9 * 20 + mask.sum() < 9 * 20 + 45  # fewer than causal's pairs
    rows = bench.run("extend", [case], backends=["jaxattn", "jaxattn-unified", "reference"], log=lambda _: None,
                     progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn", "jaxattn-unified", "reference"]
    two_stage, unified, want = one_call[-3:]
    np.testing.assert_allclose(two_stage, want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(unified, want, atol=2e-2, rtol=2e-2)
    causal = bench.make_inputs(bench.Case("TC", "extend", batch=2, prefix=20, new=9, q_heads=4, kv_heads=2, head_dim=64))
    assert bench.peers.extend_reference(causal)().shape == want.shape
    assert not np.allclose(np.asarray(bench.peers.extend_reference(causal)(), np.float32), want, atol=1e-3)  # the mask matters
    # The same tree as per-row draft words (extend_attention(draft_mask=): the Triton kernel here) gives the same rows.
    rows = bench.run("extend", [case], backends=["jaxattn-draft-words", "reference"], log=lambda _: None, progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn-draft-words", "reference"]
    np.testing.assert_allclose(one_call[-2], one_call[-1], atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(one_call[-1], want, atol=1e-5, rtol=1e-5)  # the reference saw the same mask
    # Under a window (a sliding-window layer's verify step): the floor's pairs are the brute-force count, and the
    # rows still agree with the reference.
    windowed = dataclasses.replace(case, sliding_window=12)
    q_pos, k_pos = 20 + np.arange(9)[:, None], np.arange(29)[None, :]
    sees = np.concatenate([np.ones((9, 20), bool), mask], axis=1) & (q_pos - k_pos <= 12)
    assert windowed.visible_pairs() == sees.sum() < case.visible_pairs()
    rows = bench.run("extend", [windowed], backends=["jaxattn", "reference"], log=lambda _: None, progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn", "reference"]
    np.testing.assert_allclose(one_call[-2], one_call[-1], atol=2e-2, rtol=2e-2)


def test_fp8_split_rows_run_the_kernel_at_their_split_counts(one_call):
    # The "fp8 waves" / "fp8 splits=N" sweep rows (split counts by waves of resident programs, or fixed) through the
    # interpreter: each row's output is the reference's, over a pool 2 splits long (301 keys, 256 a split at least).
    case = bench.Case("TF", "decode", batch=2, prefix=300, new=1, q_heads=8, kv_heads=2, head_dim=128,
                      kv_dtype="float8_e4m3fn")
    rows = bench.run("decode", [case], backends=["reference"], sweep="^fp8 (waves|splits=(1|2))$", log=lambda _: None,
                     progress=False)
    assert [r["backend"] for r in rows] == ["reference", "sweep[fp8 waves]", "sweep[fp8 splits=1]", "sweep[fp8 splits=2]"]
    for out in one_call[1:]:
        np.testing.assert_allclose(out, one_call[0], atol=2e-2, rtol=2e-2)


def test_sweep_takes_a_label_regex(one_call, monkeypatch):
    # --sweep REGEX times only the candidate configurations whose label it finds (here the keys-as-rows decode tiles,
    # run through the interpreter); --sweep alone parses to True (all of them).
    case = TINY[0]
    labels = [label for label, _ in bench.sweep_variants("decode", case)]
    wanted = [label for label in labels if label.startswith("keys-as-rows h16 n32")]
    assert wanted and len(wanted) < len(labels)
    rows = bench.run("decode", [case], backends=["reference"], sweep="^keys-as-rows h16 n32", log=lambda _: None,
                     progress=False)
    assert [r["backend"] for r in rows] == ["reference"] + [f"sweep[{label}]" for label in wanted]
    for out in one_call[1:]:  # each config's output is the reference's
        np.testing.assert_allclose(out, one_call[0], atol=2e-2, rtol=2e-2)
    sweeps = []
    monkeypatch.setattr(cli, "run", lambda op, cases, backends, sweep=False, **_: sweeps.append(sweep) or [])
    monkeypatch.setattr(cli, "commit", lambda: "abc1234")
    for extra in (["--sweep"], ["--sweep", "mgpu"], []):
        assert bench.main(["decode", "--cases", "D1", "--no-progress", *extra]) == 0
    assert sweeps == [True, "mgpu", False]


def test_fp8_extend_sweep_times_both_conversions():
    # An fp8 extend case's sweep has the in-kernel route with each conversion on each tile that fits sm_90 (f16
    # tiles and q_dtype tiles), a bf16 case none of them.
    # And each with the fp8 staging tiles.
    variants = dict(bench.sweep_variants("extend", bench.CASES["E1-FP8"]))
    for tiles in ("f16", "q_dtype"):
        assert variants[f"mgpu-fp8 {tiles} kv128 s2"].__defaults__[0].fp8_tiles == tiles
        staged = variants[f"mgpu-fp8 {tiles} kv128 s2 staged"].__defaults__[0]
        assert staged.fp8_tiles == tiles and staged.fp8_staging
        assert not variants[f"mgpu-fp8 {tiles} kv128 s2"].__defaults__[0].fp8_staging  # named: in the slot
        refill = variants[f"mgpu-fp8 {tiles} kv128 s2 staged refill"].__defaults__[0]
        assert refill.fp8_staging and refill.fp8_refill and not staged.fp8_refill
    assert not any(label.startswith("mgpu-fp8") for label, _ in bench.sweep_variants("extend", bench.CASES["E1"]))


def test_mla_sweep_times_both_tiles():
    # MLA's one-token decode sweep has the transposed tile (the default there) and the padded one, forced by config;
    # the 4-token verify case neither (the transposed tile takes one token).
    variants = dict(bench.sweep_variants("decode", bench.CASES["MLA"]))
    assert variants["mgpu transposed splits=own"].__defaults__[0].transposed is True
    assert variants["mgpu padded splits=own"].__defaults__[0].transposed is False
    verify = [label for label, _ in bench.sweep_variants("decode", bench.CASES["MLA-V4"])]
    assert not any("transposed" in label or "padded" in label for label in verify)


def test_commit_falls_back_to_the_environment(monkeypatch):
    def no_git(*args, **kwargs):
        raise OSError("git: not found")

    monkeypatch.setattr(report.subprocess, "run", no_git)
    monkeypatch.setenv("JAXATTN_COMMIT", "feed123")
    assert bench.commit() == "feed123"
    monkeypatch.delenv("JAXATTN_COMMIT")
    assert bench.commit() == "unknown"


def test_plot_needs_rows(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no rows"):
        bench.plot_rows([], str(tmp_path / "x.png"))


def test_feature_cases_run_each_backend_with_the_feature(one_call):
    # A window, a soft cap and sinks reach the kernel and the reference alike (their outputs agree), and the floor
    # counts only the pairs a windowed query sees.
    case = bench.Case("TF", "extend", batch=2, prefix=24, new=16, q_heads=4, kv_heads=2, head_dim=64, sliding_window=9,
                      logit_cap=5.0, sinks=True)
    rows = bench.run("extend", [case], backends=["jaxattn", "jaxattn-unified", "reference", "flashinfer-fa3"],
                     log=lambda _: None, progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn", "jaxattn-unified", "reference"]  # FlashInfer: not installed
    np.testing.assert_allclose(one_call[0], one_call[2], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(one_call[1], one_call[2], atol=1e-4, rtol=1e-4)
    plain = bench.Case("TP", "extend", batch=2, prefix=24, new=16, q_heads=4, kv_heads=2, head_dim=64)
    assert not np.allclose(one_call[2], np.asarray(bench.peers.extend_reference(bench.make_inputs(plain))(), np.float32))
    assert case.visible_pairs() == 16 * 10  # every query sees W + 1 = 10 keys
    assert bench.CASES["E1-W1024"].visible_pairs() == 2048 * 1025


def test_unified_window_rows_take_the_full_lists_where_the_backend_does(monkeypatch):
    # jaxattn-unified on a window case gets the lists TritonBackend's deterministic window layers get: full lists with
    # the window as the op's argument where the Mosaic GPU kernel takes the call (on sm_90), else window-cut ones.
    from jaxattn import hardware

    case = bench.Case("TW", "extend", batch=2, prefix=24, new=16, q_heads=4, kv_heads=2, head_dim=64, sliding_window=9)
    inp = bench.make_inputs(case)
    assert bench.peers.extend_meta(inp, unified=True, full_window_lists=True).sliding_window == 9  # CPU: cut
    monkeypatch.setattr(hardware, "mosaic_gpu_unavailable", lambda mode: None)  # as on an sm_90 GPU
    assert bench.peers.extend_meta(inp, unified=True, full_window_lists=True).sliding_window == -1
    assert bench.peers.extend_meta(inp, unified=True).sliding_window == 9  # a named implementation's rows
    assert bench.peers.extend_meta(inp).sliding_window == 9  # two-stage: cut, as TritonBackend builds them


def test_feature_cases_are_in_the_default_extend_run():
    defaults = [name for name, c in bench.CASES.items() if c.op == "extend" and c.default]
    assert {"E1-W1024", "E1-CAP50", "E1-W1024-CAP50", "E1-SINKS"} <= set(defaults)


def test_fp8_cases_read_the_pool_with_its_scales(one_call):
    # An fp8 case's pool holds value / scale; jaxattn (decode, both extend forms) and the reference read it with the
    # scales and agree, and the decode floor is half the bf16 one (one byte per element).
    decode = bench.Case("TD8", "decode", batch=2, prefix=40, new=1, q_heads=4, kv_heads=2, head_dim=64, kv_dtype="float8_e4m3fn")
    rows = bench.run("decode", [decode], backends=["jaxattn", "reference"], log=lambda _: None, progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn", "reference"]
    # bf16 tolerance: jaxattn's fp8 decode dots run in f16 with q pre-scaled (kernels/decode_attention.py), so outputs
    # may differ from the reference by a bf16 rounding step.
    np.testing.assert_allclose(one_call[0], one_call[1], **testing.tolerance(jnp.bfloat16))
    assert decode.floor_ms() == pytest.approx(bench.Case("TD", "decode", 2, 40, 1, 4, 2, 64).floor_ms() / 2)
    extend = bench.Case("TE8", "extend", batch=2, prefix=24, new=16, q_heads=4, kv_heads=2, head_dim=64, kv_dtype="float8_e4m3fn")
    rows = bench.run("extend", [extend], backends=["jaxattn", "jaxattn-unified", "reference"], log=lambda _: None, progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn", "jaxattn-unified"]  # the reference row: skipped (see peers)
    np.testing.assert_allclose(one_call[2], one_call[3], atol=1e-4, rtol=1e-4)
    inp = bench.make_inputs(extend)
    assert str(inp.k_pool.dtype) == "float8_e4m3fn" and inp.k_scale == 0.5


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_paged_inputs_scatter_whole_pages_and_keep_each_tokens_kv(case, page_size):
    from jaxattn.backends.flashinfer import paged_kv_lists

    flat, paged = bench.make_inputs(case), bench.make_inputs(bench.paged_case(case, page_size))
    assert paged.case.name == f"{case.name}-P{page_size}" and paged.case.floor_ms() == case.floor_ms()
    pages, slots = np.asarray(paged.req_to_page), np.asarray(paged.req_to_token)
    length = case.prefix + case.new
    assert pages.shape == (case.batch, -(-length // page_size)) and paged.k_pool.shape[0] == (pages.size + 1) * page_size
    # Pages 1.. each once (page 0 is padding), in random order; token pos at page * P + pos % P (contiguous in a page).
    assert sorted(pages.reshape(-1)) == list(range(1, pages.size + 1)) and not np.all(np.diff(pages.reshape(-1)) > 0)
    pos = np.arange(length)
    np.testing.assert_array_equal(slots, pages[:, pos // page_size] * page_size + pos % page_size)
    # The same tokens as page 1, each with its page-1 K/V; the lists count the same keys.
    for name in ("qo_indptr", "kv_indptr", "prefix_indptr", "seq_lens", "prefix_lens"):
        np.testing.assert_array_equal(getattr(paged, name), getattr(flat, name))
    np.testing.assert_array_equal(paged.kv_indices, slots.reshape(-1))
    for pool in ("k_pool", "v_pool"):
        np.testing.assert_array_equal(np.asarray(getattr(paged, pool), np.float32)[slots],
                                      np.asarray(getattr(flat, pool), np.float32)[np.asarray(flat.req_to_token)])
    np.testing.assert_array_equal(np.asarray(paged.k_new, np.float32), np.asarray(flat.k_new, np.float32))
    # FlashInfer's plan lists (what its bench rows plan): the page ids, expanded, are the token lists.
    indptr, page_ids, last = paged_kv_lists(pages, np.arange(case.batch), np.zeros(case.batch, int), np.asarray(paged.seq_lens),
                                            page_size)
    np.testing.assert_array_equal(page_ids, pages.reshape(-1))
    np.testing.assert_array_equal(last, [length - (pages.shape[1] - 1) * page_size] * case.batch)
    expanded = (page_ids[:, None] * page_size + np.arange(page_size)).reshape(case.batch, -1)[:, :length]
    np.testing.assert_array_equal(expanded.reshape(-1), np.asarray(paged.kv_indices))


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_paged_cases_compute_the_page_one_attention(one_call, case):
    rows = bench.run(case.op, [case], backends=["jaxattn", "reference"], log=lambda _: None, progress=False,
                     page_sizes=(1, 8, 16))
    names = [case.name, f"{case.name}-P8", f"{case.name}-P16"]
    assert [(r["case"], r["backend"]) for r in rows] == [(n, b) for n in names for b in ("jaxattn", "reference")]
    assert len({r["floor_ms"] for r in rows}) == 1
    jaxattn_out, reference_out = one_call[0::2], one_call[1::2]
    for got in reference_out[1:]:
        np.testing.assert_array_equal(got, reference_out[0])
    for got in jaxattn_out:
        np.testing.assert_allclose(got, reference_out[0], atol=2e-2, rtol=2e-2)
    assert "| jaxattn | 1.000 ms" in bench.markdown_table(rows) and f"{case.name}-P16 (floor" in bench.markdown_table(rows)


def test_page_sizes_and_paged_case_names_on_the_command_line(monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "run", lambda op, cases, *a, **k: ran.append((cases, k["page_sizes"])) or [])
    monkeypatch.setattr(cli, "commit", lambda: "abc1234")
    assert bench.main(["decode", "--cases", "D1", "--no-progress"]) == 0
    assert bench.main(["decode", "--cases", "D1,D2", "--page-sizes", "1,16,64", "--no-progress"]) == 0
    assert ran == [(["D1"], (1,)), (["D1", "D2"], (1, 16, 64))]
    with pytest.raises(SystemExit, match="--page-sizes must be comma-separated page sizes of"):
        bench.main(["decode", "--page-sizes", "1,12", "--no-progress"])
    assert bench.case_named("D1-P16") == bench.paged_case(bench.CASES["D1"], 16)
    assert bench.case_named("E1-W1024-CAP50") is bench.CASES["E1-W1024-CAP50"] and bench.case_named("D9-P16") is None
    with pytest.raises(ValueError, match="page_size must be one of"):
        bench.paged_case(bench.CASES["D1"], 12)


def test_verify_case_runs_decode_beside_extend(one_call):
    # A decode case with several new tokens is a verify step: the several-token decode, the extend op over the same
    # step and the reference agree (MLA's latent shape, V inside K), and the floor reads every key once.
    case = bench.Case("TV", "decode", batch=2, prefix=37, new=3, q_heads=4, kv_heads=1, head_dim=576, v_head_dim=512)
    rows = bench.run("decode", [case], backends=["jaxattn", "jaxattn-extend", "reference"], log=lambda _: None,
                     progress=False)
    assert [r["backend"] for r in rows] == ["jaxattn", "jaxattn-extend", "reference"]
    decode_out = one_call[0].reshape(2 * 3, 4, 512)
    np.testing.assert_allclose(decode_out, one_call[2], **testing.tolerance(jnp.bfloat16))
    np.testing.assert_allclose(one_call[1], one_call[2], **testing.tolerance(jnp.bfloat16))
    assert case.floor_ms() == pytest.approx(2 * 40 * 576 * 2 / 4.3e12 * 1e3)
    assert bench.CASES["MLA-V4"].floor_ms() == pytest.approx(bench.CASES["MLA"].floor_ms())


def test_every_backend_has_a_label():
    # The report names each row by LABELS; a backend without one would print its key.
    for op, backends in bench.BACKENDS.items():
        missing = [name for name in backends if name not in bench.LABELS]
        assert not missing, (op, missing)


def test_ffi_rows_skip_without_jax_tvm_ffi(monkeypatch):
    # The FFI launch rows (issue 24's target: FlashInfer from jit within 1% of torch) need jax-tvm-ffi; without it
    # they are skipped with the reason, not failed.
    from jaxattn.backends import flashinfer_ffi
    from jaxattn.bench import peers

    import sys
    import types

    monkeypatch.setattr(flashinfer_ffi, "ffi_available", lambda: False)
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.6.0"))
    peers.ffi_launcher.cache_clear()
    with pytest.raises(bench.Skip, match=r"the FlashInfer FFI launch needs jax-tvm-ffi \(pip install 'jaxattn\[flashinfer-ffi\]'"):
        peers.ffi_launcher()
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.7.4"))
    monkeypatch.setattr(flashinfer_ffi, "ffi_available", lambda: True)
    with pytest.raises(bench.Skip, match=r"replays flashinfer 0\.6\.x's run\(\) calls; flashinfer 0\.7\.4 is installed"):
        peers.ffi_launcher()
    assert {"flashinfer-ffi-8-layers", "flashinfer-ffi"} <= set(bench.BACKENDS["decode"])
    assert {"flashinfer-fa3-ffi-8-layers", "flashinfer-fa3-in-jit-8-layers"} <= set(bench.BACKENDS["extend"])


def test_torch_layers_rows_launch_into_their_own_outputs_and_lses():
    # flashinfer-8-layers / flashinfer-fa3-8-layers: the torch-launched peer of the *-ffi-8-layers rows, 8 launches per
    # timed call (time_calls divides by them), each into its own preallocated output and LSE, as the FFI launch
    # writes both.
    import types

    from jaxattn.bench.peers import torch_layers

    class Wrapper:
        def __init__(self):
            self.launches = []

        def run(self, q, kv, *variant, out=None, lse=None, return_lse=False, **kwargs):
            self.launches.append((variant, out, lse, return_lse, kwargs))

    fake_torch = types.SimpleNamespace(float32="f32", empty=lambda *shape, dtype, device: (shape, dtype, object()))
    q = types.SimpleNamespace(shape=(6, 4, 576), dtype="bf16", device="cuda")
    wrapper = Wrapper()
    step = torch_layers(fake_torch, wrapper, q, ("k", "v"), 512, 8, "sinks", k_scale=0.5)
    assert step.calls == 8 and wrapper.launches == []
    step()
    assert len(wrapper.launches) == 8
    assert {len({id(launch[1]) for launch in wrapper.launches}), len({id(launch[2]) for launch in wrapper.launches})} \
        == {8}
    for variant, out, lse, return_lse, kwargs in wrapper.launches:
        assert variant == ("sinks",) and return_lse and kwargs == {"k_scale": 0.5}
        assert out[:2] == ((6, 4, 512), "bf16") and lse[:2] == ((6, 4), "f32")
    assert {"flashinfer-8-layers"} <= set(bench.BACKENDS["decode"])
    assert {"flashinfer-fa3-8-layers"} <= set(bench.BACKENDS["extend"])


def test_layers_of_a_step_run_in_order():
    # A model's layer i reads layer i - 1's output; the 8-layer rows' calls are chained the same way (each query
    # behind an optimization barrier with the previous output), so XLA cannot run two at once or reorder them.
    import jax
    import jax.numpy as jnp

    from jaxattn.bench.peers import chained_layers

    qs = [jnp.full((4,), float(i)) for i in range(5)]
    step = chained_layers(lambda q, k: q * k)
    jaxpr = str(jax.make_jaxpr(step)(qs, jnp.float32(2.0)))
    assert jaxpr.count("optimization_barrier") == 4, jaxpr
    np.testing.assert_array_equal(np.stack(jax.jit(step)(qs, jnp.float32(2.0))), 2.0 * np.stack(qs))


def test_jaxattn_layers_rows_run_distinct_calls_in_one_step(one_call):
    # jaxattn-8-layers: 8 calls in one jitted step on distinct queries (as a model's layers), timed per call; layer 0
    # is the plain call's query, so its output is the reference's, and the others differ (not merged into one call).
    for case in TINY:
        rows = bench.run(case.op, [case], backends=["jaxattn-8-layers", "reference"], log=lambda _: None,
                         progress=False)
        assert [r["backend"] for r in rows] == ["jaxattn-8-layers", "reference"]
        layers, want = one_call[-2:]
        assert layers.shape == (8, case.batch * case.new, case.q_heads, case.dv)
        np.testing.assert_allclose(layers[0], want, atol=2e-2, rtol=2e-2)
        assert not np.allclose(layers[1], layers[0], atol=0, rtol=1e-3)


@pytest.mark.parametrize("launch", ["ffi", "bridge"])
def test_flashinfer_in_jit_layers_make_distinct_calls_without_side_effects(monkeypatch, launch):
    # flashinfer-ffi-8-layers / flashinfer-in-jit-8-layers: one jitted step of 8 FlashInfer calls as jaxattn's layered
    # rows make theirs (distinct queries, each call after the one before), none with has_side_effect, which as a JAX
    # effect would keep the step off JAX's C++ dispatch path (FlashInferBackend's calls have none).
    import types

    import jax
    import jax.numpy as jnp

    from jaxattn.backends import flashinfer as flashinfer_backend
    from jaxattn.bench import peers

    calls = []

    def fake_run(wrapper, q, k, v, dv, **kwargs):
        calls.append(kwargs)
        return q[..., :dv] * 2 + k.sum(), None

    monkeypatch.setattr(flashinfer_backend, "bridged_run", fake_run)
    monkeypatch.setattr(peers, "ffi_launcher", lambda: types.SimpleNamespace(run=fake_run))
    case = types.SimpleNamespace(dv=4, page_size=1)
    q = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)
    inp = types.SimpleNamespace(case=case, q=q, k_pool=jnp.zeros((5, 1, 4)), v_pool=jnp.zeros((5, 1, 4)))
    step = peers.bridged("wrapper", inp, 8, launch=launch)
    outs = jax.block_until_ready(step())
    assert step.calls == 8 and len(outs) == 8 and len(calls) == 8
    assert all("has_side_effect" not in kwargs for kwargs in calls)
    assert len({float(o.sum()) for o in outs}) == 8  # distinct queries: no two calls XLA could merge
