"""jaxattn: SGLang's LLM-serving attention layer for JAX, on Triton kernels."""

import importlib.util as _importlib_util
import os as _os
import sys as _sys


def _map_source_kernels():
    # Installed, the Triton sources are the subpackage jaxattn/kernels. In a source checkout run without
    # installing (e.g. PYTHONPATH=. on the GPU machine) they sit beside this package in ../kernels.
    # The checkout's own kernels/ wins over an import hook's: an editable install of another checkout (a git
    # worktree beside it) would otherwise hand this checkout's jaxattn the other one's kernels.
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.isdir(_os.path.join(here, "kernels")) or "jaxattn.kernels" in _sys.modules:
        return
    source = _os.path.join(_os.path.dirname(here), "kernels")
    init = _os.path.join(source, "__init__.py")
    if not _os.path.isfile(init):
        return  # an installed layout: jaxattn/kernels is resolved by the installer's import hook
    spec = _importlib_util.spec_from_file_location("jaxattn.kernels", init, submodule_search_locations=[source])
    module = _importlib_util.module_from_spec(spec)
    _sys.modules["jaxattn.kernels"] = module
    spec.loader.exec_module(module)


_map_source_kernels()
