"""The module map's import rules, checked by reading the source with `ast` (nothing is imported, so
this runs without torch). docs/architecture.md states the map; this file enforces it:

- no import cycles between eagle3lib modules (module-level imports, nor through imports inside
  functions);
- the planners (`plan`, `mode_plan`, `stage_times`, `memory`, `preflight`, `engine_memory`) are imported
  only by the entry points and `train`: nothing they model reaches up to them;
- nothing imports the entry points (`runner`, `cli`), except `cli` loading `runner` lazily;
- inference (`decode`, `export`, `drafters`, `evaluate`, `verdict`) never reaches training (`train`, `objective`,
  `batches`, `checkpoints`, `muon`, `memory`), directly or through another module;
- training and evaluation read the cache through `cache`, never through the extraction stage;
- committed notebooks carry no outputs;
- the light modules (`params`, `layout`, `files`, `plan`, `mode_plan`, `cli`, `stage_times`, `preflight`,
  `checkpoint_keys`) load no
  heavy package (torch, transformers, vllm, datasets, ...) at import time, directly or through another
  eagle3lib module.
"""
from __future__ import annotations

import ast
import json
from functools import lru_cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3lib"
HEAVY = {"torch", "transformers", "vllm", "datasets", "safetensors", "numpy", "pandas", "matplotlib",
         "papermill", "nbformat", "pyarrow", "gguf", "ipywidgets", "tqdm"}
LIGHT = ("params", "layout", "files", "plan", "mode_plan", "cli", "stage_times", "preflight", "checkpoint_keys")
INFERENCE = ("decode", "export", "drafters", "evaluate", "verdict")
TRAINING = ("train", "objective", "batches", "checkpoints", "muon", "memory")
ENTRY_POINTS = ("runner", "cli")
PLANNERS = ("plan", "mode_plan", "stage_times", "memory", "preflight", "engine_memory")
PLANNER_USERS = ENTRY_POINTS + ("train",)


def modules() -> list:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def imports_of(source: str) -> tuple[set, set, set]:
    """(eagle3lib modules imported at module level, those imported inside functions, top-level
    packages imported at module level) of one module's source. `if TYPE_CHECKING:` blocks do not
    count (nothing runs them)."""
    tree = ast.parse(source)
    eager, lazy, packages = set(), set(), set()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:                                  # from .x import y / from . import x
                    names = [child.module] if child.module else [a.name for a in child.names]
                    (lazy if inner else eager).update(n.split(".")[0] for n in names)
                elif child.module and child.module.split(".")[0] == "eagle3lib":
                    rest = child.module.split(".")[1:]
                    names = rest[:1] or [a.name for a in child.names]
                    (lazy if inner else eager).update(names)
                elif child.module and not inner:
                    packages.add(child.module.split(".")[0])
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    top = alias.name.split(".")
                    if top[0] == "eagle3lib" and len(top) > 1:
                        (lazy if inner else eager).add(top[1])
                    elif not inner:
                        packages.add(top[0])
            visit(child, inner)
    visit(tree, False)
    return eager, lazy, packages


@lru_cache(maxsize=None)
def graph() -> dict:
    """{module: (eager eagle3lib imports, lazy ones, third-party packages at module level)}."""
    return {m: imports_of((PACKAGE / f"{m}.py").read_text()) for m in modules()}


def reachable(start: str, include_lazy: bool = False) -> set:
    """Every eagle3lib module `start` loads (module-level imports, transitively; lazy ones too if asked)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        eager, lazy, _ = graph()[m]
        for nxt in eager | (lazy if include_lazy else set()):
            if nxt in graph() and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def find_cycle(edges: dict) -> list:
    """One import cycle as a list of modules, or [] (depth-first search)."""
    state, stack = {}, []

    def dfs(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if n not in edges:
                continue
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := dfs(n)):
                return found
        state[m] = "done"
        stack.pop()
        return []
    for m in sorted(edges):
        if m not in state and (found := dfs(m)):
            return found
    return []


def test_the_parser_sees_every_kind_of_import():
    src = ("import torch\nfrom . import files\nfrom .cache import HiddenCache\nimport eagle3lib.layout\n"
           "from eagle3lib.params import Params\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from .train import train\n"
           "def f():\n    import vllm\n    from .plan import capacity_plan\n")
    eager, lazy, packages = imports_of(src)
    assert eager == {"files", "cache", "layout", "params"} and lazy == {"plan"}
    assert packages == {"torch", "typing"}


def test_no_import_cycles():
    """Not at module level, and not through an import inside a function either: a lazy import only
    defers a circle (batches reached up to mode_plan for a constant, which reached plan and memory,
    which reached objective, which reached batches)."""
    assert find_cycle({m: g[0] for m, g in graph().items()}) == []
    assert find_cycle({m: g[0] | g[1] for m, g in graph().items()}) == []


def test_the_planners_sit_above_what_they_model():
    """Only the entry points and the training stage (which refuses a step that does not fit) import
    a planner; the constants a planner needs live with the code they describe (PREFETCH_FACTOR in
    batches), read by the planner."""
    for m, (eager, lazy, _) in graph().items():
        if m in PLANNERS or m in PLANNER_USERS:
            continue
        assert not (eager | lazy) & set(PLANNERS), f"{m} imports planner(s) {sorted((eager | lazy) & set(PLANNERS))}"


def test_a_planted_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_nothing_imports_the_entry_points():
    for m, (eager, lazy, _) in graph().items():
        for entry in ENTRY_POINTS:
            if m == "cli" and entry == "runner":
                assert entry not in eager, "cli loads runner lazily (papermill only for `eagle3 run`)"
                continue
            assert entry not in eager | lazy, f"{m} imports {entry}"


@pytest.mark.parametrize("module", INFERENCE)
def test_inference_never_reaches_training(module):
    reached = reachable(module, include_lazy=True) & set(TRAINING)
    assert not reached, f"{module} reaches training modules {sorted(reached)}"


@pytest.mark.parametrize("module", ("train", "objective", "evaluate", "scaling", "memory", "decode"))
def test_training_and_evaluation_read_the_cache_not_the_extraction_stage(module):
    reached = reachable(module, include_lazy=True) & {"extract", "extract_vllm"}
    assert not reached, f"{module} reaches {sorted(reached)}; read the cache through cache.py"


@pytest.mark.parametrize("module", LIGHT)
def test_light_modules_load_no_heavy_package_at_import(module):
    loaded = {module} | reachable(module)
    heavy = {m: sorted(graph()[m][2] & HEAVY) for m in loaded if graph()[m][2] & HEAVY}
    assert not heavy, f"importing eagle3lib.{module} loads heavy packages: {heavy}"


def test_committed_notebooks_carry_no_outputs():
    """Executed copies live in outputs/<run>/; the notebooks in git hold code and narrative only."""
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        dirty = [i for i, c in enumerate(cells) if c["cell_type"] == "code"
                 and (c.get("outputs") or c.get("execution_count") is not None)]
        assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them (jupyter nbconvert --clear-output)"


def test_train_leaves_the_distributed_wrapping_to_parallel():
    """FSDP2 / DDP symbols live in parallel.py; train.py imports none of them."""
    source = (PACKAGE / "train.py").read_text()
    for symbol in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "DistributedDataParallel",
                   "register_fsdp_forward_method"):
        assert symbol not in source, f"train.py names {symbol}; it belongs in parallel.py"


def test_committed_notebook_cells_carry_ids():
    """nbformat 4.5 cells need an id (a missing one warns now and will be an error)."""
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        missing = [i for i, c in enumerate(cells) if "id" not in c]
        assert not missing, f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"
