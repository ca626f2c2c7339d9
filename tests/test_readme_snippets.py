"""Every ```python block of README.md runs on CPU, in order, in one namespace (like a notebook).

A block whose first line is ``# not run: ...`` is skipped (it needs a GPU); one whose first line is
``# requires: some.module`` runs only when that module imports.
"""

import importlib.util
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks(text):
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]


def test_readme_snippets_run():
    with open(README) as f:
        blocks = python_blocks(f.read())
    assert len(blocks) >= 7, "README's snippets were not found"
    namespace, ran, skipped = {"__name__": "readme"}, 0, []
    for i, block in enumerate(blocks):
        first = block.splitlines()[0].strip()
        if first.startswith("# not run"):
            skipped.append(first)
            continue
        required = re.match(r"# requires: ([\w.]+)", first)
        if required and importlib.util.find_spec(required.group(1)) is None:
            skipped.append(first)
            continue
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"README python block {i} failed: {type(error).__name__}: {error}\n---\n{block}")
        ran += 1
    assert ran >= 5, (ran, skipped)
