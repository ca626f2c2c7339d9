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
