"""Tiny notebooks for runner tests: a `parameters` cell like the real notebooks', then `cells`."""
from __future__ import annotations

import nbformat


def tiny_notebook(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('params_path = "params/ci.yaml"\nrun_name = None')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(c) for c in cells]
    return nb
