"""The package is layered: each module imports only its own layer and the ones below, no import
cycle exists (imports inside functions included), the library never imports the CLI or the
bench's extras, and only ``tieroffload.compat`` touches private torch names."""

from __future__ import annotations

import ast
import pathlib

import pytest

import tieroffload

ROOT = pathlib.Path(tieroffload.__file__).parent

# Lowest first. A module may import modules of its own layer or of a layer below.
LAYERS = [
    {"_native", "_version"},
    {"utils", "compat", "testing"},
    {"aio"},
    {"core"},
    {"integrations"},
    {"hooks"},
    {"optim"},
    {"checkpoint"},
    {"planner"},
    {"policy", "hf"},
    {"monitor"},
    {"dropin"},
    {"__init__"},
    {"cli", "__main__"},
]
BENCH_EXTRAS = {"tqdm", "aiofiles", "matplotlib"}


def layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its top package to LAYERS")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = ["tieroffload", *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str],
            typed: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) of every import in the file, at any depth (inside functions
    too; under ``if TYPE_CHECKING`` only where ``typed``), relative ones resolved;
    ``from pkg import sub`` counts as importing ``pkg.sub`` where that is a module."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    hints = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If)
             and ast.unparse(t.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
             for stmt in t.body for n in ast.walk(stmt)} if not typed else set()
    out = []
    for node in ast.walk(tree):
        if id(node) in hints:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in known else target, node.lineno))
    return out


MODULES = modules()
KNOWN = set(MODULES) | {"tieroffload._native"}  # the extension is no .py file
GRAPH = {m: [(t, line) for t, line in imports(m, p, KNOWN)
             if t == "tieroffload" or t.startswith("tieroffload.")]
         for m, p in MODULES.items()}


def test_every_module_imports_only_its_layer_and_below():
    wrong = []
    for m, edges in GRAPH.items():
        for t, line in edges:
            if t == "tieroffload._native":
                continue
            if layer_of(t) > layer_of(m):
                wrong.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}")
    assert not wrong, "imports from a higher layer:\n" + "\n".join(wrong)


def test_there_is_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t, _ in GRAPH.get(m, []):
            if t not in GRAPH:
                continue
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state.get(t) is None:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_library_never_imports_the_cli_or_the_bench_extras():
    wrong = []
    for m, p in MODULES.items():
        if layer_of(m) == len(LAYERS) - 1:
            continue
        for t, line in imports(m, p, KNOWN):
            if t.split(".")[0] in BENCH_EXTRAS or t.startswith("tieroffload.cli"):
                wrong.append(f"{p.relative_to(ROOT)}:{line} imports {t}")
    assert not wrong, "\n".join(wrong)


def test_private_torch_names_are_used_only_in_compat():
    wrong = []
    for m, p in MODULES.items():
        if m.startswith("tieroffload.compat"):
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    "torch") and any(part.startswith("_") for part in node.module.split(".")):
                wrong.append(f"{p.relative_to(ROOT)}:{node.lineno} from {node.module}")
            if isinstance(node, ast.Attribute) and node.attr in (
                    "_C", "_execution_engine", "_cdata", "_version", "_get_fsdp_state",
                    "_sharded_param_data", "_local_tensor", "_module_info", "_pytree"):
                wrong.append(f"{p.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not wrong, "private torch names outside tieroffload.compat:\n" + "\n".join(wrong)


# Packages whose modules still import each other for annotations only (under TYPE_CHECKING):
# hooks.registry is typed by the OffloadState it holds, which uses the registry.
TYPED_CYCLES_LEFT = {"hooks"}


def test_no_import_cycle_even_counting_imports_for_annotations_only():
    """A package reads bottom-up: no cycle either through imports made for type hints only
    (``if TYPE_CHECKING``), which a Protocol or a lower module can always replace."""
    graph = {m: [t for t, _ in imports(m, p, KNOWN, typed=True) if t in MODULES]
             for m, p in MODULES.items()}

    def left(m: str) -> bool:
        return m.split(".")[1] in TYPED_CYCLES_LEFT if "." in m else False

    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if left(m) and left(t):
                continue
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if state.get(t) is None:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
