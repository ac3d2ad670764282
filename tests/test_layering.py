"""Which module of lamina may import which: read from the source (every import statement,
function-level ones too), so a change that makes the core depend on a backend fails here.

    application   io, serve, distributed, training, zoo, cli, testing, the package itself
        |
    backends      backends/cpu (with its compiled modules), backends/opencl (with opencl_array,
                  opencl_plan and the compiled _opencl_steps), backends/reference
        |              (import the contract and the foundation only)
    model         graph, sample_shapes, scheduler, optim, layers/*: the backend registry (lamina.backends) is
        |              their only way to a backend, asked at run time
    contract      backends/base, geometry, columns, stepwise, checks
        |
    foundation    errors, types, extras, random, rwlock, processor, precision, sequence, selection,
                  threads, packing, parameter

A module imports from its own level and the levels below it; nothing below the backends imports
a backend or a compiled module."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "runtime"
FOUNDATION = {"errors", "types", "extras", "random", "rwlock", "processor", "precision", "sequence", "selection",
              "threads", "packing", "parameter"}
CONTRACT = {"backends.base", "backends.geometry", "backends.columns", "backends.stepwise", "backends.checks"}
MODEL = {"graph", "sample_shapes", "scheduler", "optim", "layers"}
BACKENDS = {"backends.cpu", "backends.opencl", "backends.opencl_array", "backends.opencl_plan",
            "backends._opencl_steps", "backends.reference"}
REGISTRY = "backends"  # lamina.backends itself: get_backend, which imports a backend when asked
ORDER = ["foundation", "contract", "model", "backends", "application"]


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def level(name):
    """The level of a module named relative to lamina ('' is the package itself)."""
    for group, members in (("foundation", FOUNDATION), ("contract", CONTRACT), ("model", MODEL),
                           ("backends", BACKENDS)):
        if any(name == m or name.startswith(m + ".") for m in members):
            return group
    return "registry" if name == REGISTRY else "application"


def imported(path, source=None):
    """The lamina modules a source file imports (its text, or `source` in its place), relative to
    lamina (each `from X import y` gives X.y where that is a module, else X)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["lamina"] + package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                candidate = f"{module}.{a.name}"
                relative = candidate.removeprefix("lamina.").replace(".", "/")
                is_module = any((ROOT / f"{relative}{suffix}").exists() for suffix in (".py", ".pyi")) \
                    or (ROOT / relative).is_dir()
                found.add(candidate if is_module else module)
    return sorted(m.removeprefix("lamina").lstrip(".") for m in found if m == "lamina" or m.startswith("lamina."))


SOURCES = sorted(p for p in ROOT.rglob("*.py") if "grpc" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_its_own_level_and_below(path):
    mine = level(module_name(path))
    if mine in ("application", "registry"):
        return
    allowed = ORDER[:ORDER.index(mine) + 1] + (["registry"] if mine == "model" else [])
    wrong = [m for m in imported(path) if m and level(m) not in allowed]
    assert wrong == [], f"{module_name(path)} ({mine}) imports {wrong}"


def test_nothing_below_the_backends_imports_a_backend_or_a_compiled_module():
    below = [p for p in SOURCES if level(module_name(p)) in ("foundation", "contract", "model")]
    assert len(below) > 20
    for path in below:
        for m in imported(path):
            assert not m.startswith(tuple(BACKENDS)), f"{module_name(path)} imports {m}"
            assert not m.rsplit(".", 1)[-1].startswith("_"), f"{module_name(path)} imports {m}"


def test_the_checker_sees_a_backend_import_at_any_depth():
    graph = ROOT / "graph.py"
    assert "backends" in imported(graph)  # graph asks the registry (get_backend)
    lazy = "def to(device):\n    if device:\n        from .backends.cpu import CPUBackend\n"
    assert imported(graph, lazy) == ["backends.cpu"] and level("backends.cpu") == "backends"
    assert imported(graph, "from .backends.cpu import _kernels\n") == ["backends.cpu._kernels"]


def test_the_onnx_importer_modules_import_each_other_without_a_circle():
    """The converters (one module per operator family) and the shape folding depend on the
    registry, never on the importer that looks them up: adding an operator touches one file."""
    onnx_dir = ROOT / "io" / "onnx"
    graph = {module_name(p): [m for m in imported(p) if m.startswith("io.onnx.")] for p in onnx_dir.rglob("*.py")}
    assert "io.onnx.registry" in graph and len([m for m in graph if m.startswith("io.onnx.operators.")]) >= 5
    for name, deps in graph.items():
        if name.startswith("io.onnx.operators.") or name in ("io.onnx.shapes", "io.onnx.registry"):
            assert "io.onnx.importer" not in deps, f"{name} imports the importer"
    state = {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import circle: {' -> '.join(path + [name])}"
        state[name] = "open"
        for dep in graph.get(name, ()):
            visit(dep, path + [name])
        state[name] = "done"
    for name in graph:
        visit(name, [])
