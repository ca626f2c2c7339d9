"""jaxattn's effect on the process environment: importing jax_triton must leave Triton a usable cache directory.

jax-triton 0.3.1 sets TRITON_CACHE_DIR="" when imported (0.4.x deletes it); every Triton launch made afterwards outside
jax-triton (SGLang's or torch's kernels in the same process) then fails with "Could not create or locate cache dir".
The real jax_triton cannot be imported on a CPU-only jaxlib, so a stand-in module with the same import side effect
is put first on sys.path.
"""

import os
import sys

import pytest

from jaxattn import launch as launch_module

EFFECTS = {
    "empties": 'os.environ["TRITON_CACHE_DIR"] = ""',  # jax-triton 0.3.1
    "deletes": 'os.environ.pop("TRITON_CACHE_DIR", None)',  # jax-triton 0.4.x
}


@pytest.fixture
def fake_jax_triton(tmp_path, monkeypatch, request):
    """Puts a module `jax_triton` whose import has jax-triton's effect on TRITON_CACHE_DIR first on sys.path."""
    effect = EFFECTS[request.param]
    (tmp_path / "jax_triton.py").write_text(f"import os\n{effect}\nFAKE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    yield
    sys.modules.pop("jax_triton", None)


@pytest.mark.parametrize("fake_jax_triton", sorted(EFFECTS), indirect=True)
@pytest.mark.parametrize("before", [None, "", "/tmp/somewhere/triton-cache"], ids=["unset", "empty", "set"])
def test_importing_jax_triton_leaves_triton_cache_dir_as_it_was(fake_jax_triton, monkeypatch, before):
    if before is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", before)
    jt = launch_module._import_jax_triton()
    assert getattr(jt, "FAKE", False), "the stand-in module was not the one imported"
    assert os.environ.get("TRITON_CACHE_DIR") == before


@pytest.mark.parametrize("fake_jax_triton", ["empties"], indirect=True)
def test_triton_finds_a_cache_dir_after_the_import(fake_jax_triton, monkeypatch, tmp_path):
    # What failed in the issue: Triton's file cache manager raises on an empty TRITON_CACHE_DIR.
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    launch_module._import_jax_triton()
    manager = FileCacheManager("0123456789abcdef")
    assert manager.cache_dir.startswith(str(tmp_path / "cache"))


@pytest.mark.parametrize("fake_jax_triton", ["empties"], indirect=True)
def test_a_failing_import_still_restores_the_variable(fake_jax_triton, monkeypatch, tmp_path):
    (tmp_path / "jax_triton.py").write_text('import os\nos.environ["TRITON_CACHE_DIR"] = ""\nraise ImportError("no GPU jaxlib")\n')
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/kept")
    with pytest.raises(ImportError, match="no GPU jaxlib"):
        launch_module._import_jax_triton()
    assert os.environ["TRITON_CACHE_DIR"] == "/tmp/kept"


def test_the_output_keyword_follows_the_installed_jax_triton():
    # jax-triton 0.3.1 takes out_shape=; 0.4.x takes out_type= (out_shape= still works there but is deprecated).
    def triton_call_031(*args, kernel, out_shape, grid, name="", num_warps=None, **kwargs): ...

    def triton_call_041(*args, kernel, out_type=None, grid, name="", num_warps=None, **kwargs): ...

    assert launch_module._out_keyword(triton_call_031) == "out_shape"
    assert launch_module._out_keyword(triton_call_041) == "out_type"


def test_no_product_file_names_a_path_outside_the_repository():
    # Issue 24: the anchors, notes and scripts a user needs live in the repository. Records of GPU runs
    # (benchmarks/results/, RESULTS.md's history) may quote the machines' own paths.
    import os
    import re
    import subprocess

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    outside = re.compile(r"\.\./shared|/work/|\bshared/(anchors|seeds|notes|gpu|reference|style)")
    product = [f for f in files if not f.startswith("benchmarks/results/") and f != "benchmarks/RESULTS.md"
               and f.endswith((".py", ".md", ".sh", ".toml", ".txt", ".steps", ".cfg", ".yml", ".yaml"))
               and f != "tests/test_environment.py"]
    found = []
    for name in product:
        with open(os.path.join(root, name), errors="replace") as f:
            found += [f"{name}:{n}" for n, line in enumerate(f, 1) if outside.search(line)]
    assert not found, found


def test_a_jitted_step_does_not_trace_again_when_the_mosaic_gpu_routes_import_pallas():
    # The Mosaic GPU routes' checks import Pallas inside a caller's trace; on jax 0.12 that import registers config
    # states in jit's cache key, so a step traced before it traced again afterwards. Importing jaxattn's ops must
    # already have imported it (a fresh interpreter: the suite's own imports would hide it).
    import subprocess

    code = (
        "import jax, jax.numpy as jnp\n"
        "import jaxattn.decode, jaxattn.extend, jaxattn.backends\n"
        "traces = []\n"
        "f = jax.jit(lambda x: traces.append(1) or x + 1)\n"
        "f(jnp.ones(2))\n"
        "import jax.experimental.pallas.mosaic_gpu, jaxattn.kernels.decode_attention_mgpu\n"
        "f(jnp.ones(2))\n"
        "assert len(traces) == 1, len(traces)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
