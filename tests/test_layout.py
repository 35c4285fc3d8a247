"""The package's import graph runs one way — public API (``api``, ``layer``) → autograd → kernels, with the
device and environment helpers (``env``) below everything — and no private name crosses a file. Checked on
the sources (``ast``), so a violation fails here before it becomes an import cycle somewhere else."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megamoe"


def imports_of(path: Path):
    """(module imported, names taken from it, whether the import is inside a function) of every megamoe import."""
    tree = ast.parse(path.read_text())
    nested = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megamoe"):
            names = [a.name for a in node.names]
            for name in names:  # ``from megamoe.kernels import plan`` imports the module megamoe.kernels.plan
                if (PACKAGE.parent / (node.module.replace(".", "/") + f"/{name}.py")).exists():
                    yield f"{node.module}.{name}", [], id(node) in nested
                    names = [n for n in names if n != name]
            if names:
                yield node.module, names, id(node) in nested
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megamoe"):
                    yield alias.name, [], id(node) in nested


def modules(folder: str):
    return sorted((PACKAGE / folder).rglob("*.py")) if folder else sorted(PACKAGE.glob("*.py"))


def test_kernels_and_parallel_never_import_the_public_api():
    for path in modules("kernels") + modules("parallel"):
        for module, _, _ in imports_of(path):
            assert module not in ("megamoe", "megamoe.api", "megamoe.layer", "megamoe.autograd"), \
                f"{path.relative_to(PACKAGE)} imports {module}: kernels and parallel sit below the public API"


def test_kernels_never_import_parallel_or_bench():
    for path in modules("kernels"):
        for module, _, _ in imports_of(path):
            assert not module.startswith(("megamoe.parallel", "megamoe.bench")), \
                f"{path.relative_to(PACKAGE)} imports {module}"


def test_only_the_benchmarks_import_the_benchmarks():
    """The training script and the library build their models and record provenance without ``megamoe.bench``
    (which they share through ``megamoe.models`` and ``megamoe.provenance``)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "bench":
            continue
        for module, _, _ in imports_of(path):
            assert not module.startswith("megamoe.bench"), f"{path.relative_to(PACKAGE)} imports {module}"


def test_the_package_never_imports_the_tools():
    """tools/ (instruments for kernel work, not installed) builds on the package, never the other way."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tools" or n.startswith("tools.") for n in names), \
                f"{path.relative_to(PACKAGE)} imports {names}"


def test_env_imports_nothing_of_megamoe():
    assert list(imports_of(PACKAGE / "env.py")) == []


def test_the_benchmarks_share_common_instead_of_importing_each_other():
    for a, b in (("layer", "ep"), ("ep", "layer")):
        for module, _, _ in imports_of(PACKAGE / "bench" / f"{a}.py"):
            assert module != f"megamoe.bench.{b}", f"bench/{a}.py imports bench/{b}.py"


def test_no_private_name_crosses_a_file_and_no_import_hides_in_a_function():
    for path in modules("kernels") + modules("parallel") + modules(""):
        for module, names, nested in imports_of(path):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            assert not private, f"{path.relative_to(PACKAGE)} imports private {private} from {module}"
            assert not nested, f"{path.relative_to(PACKAGE)} imports {module} inside a function"
