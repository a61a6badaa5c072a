"""Imports run downward: server -> economics (through its contract) -> engine -> models -> kernels, no cycles.

Read from the source with `ast` (imports inside functions included), so a new upward import fails here
before it can make a cycle at import time.
"""

import ast
from pathlib import Path

import pytest

import carpool

PACKAGE = Path(carpool.__file__).parent


def imports(path: Path) -> set[str]:
    """Every carpool module `path` imports, `from carpool.x import y` counted as carpool.x.y when y is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if (PACKAGE.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists()
            )
    return {name for name in found if name == "carpool" or name.startswith("carpool.")}


def modules(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offences(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in modules(package)
        for name in sorted(imports(path))
        if any(inside(name, bad) for bad in forbidden) and not any(inside(name, ok) for ok in allowed)
    ]


def test_the_walk_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("def f():\n    from carpool.server.app import create_app\n")
    assert imports(source) == {"carpool.server.app"}


def test_economics_never_imports_the_server():
    assert offences("economics", ("carpool.server", "carpool.cli", "carpool.bench")) == []


def test_the_server_reaches_economics_only_through_its_contract():
    """`carpool serve`'s command line (server/cli.py) builds the concrete gate and mounts its routes; no other
    server module knows more of economics than the contract."""
    found = offences("server", ("carpool.economics",), allowed=("carpool.economics.contract",))
    assert [line for line in found if not line.startswith("carpool/server/cli.py ")] == []


@pytest.mark.parametrize("package", ["bench", "server", "economics", "engine", "models", "kernels"])
def test_no_package_imports_the_carpool_command(package):
    """carpool/cli.py imports every area's subcommands; an area importing it back is a cycle."""
    assert offences(package, ("carpool.cli",)) == []


ABOVE = {
    "engine": ("carpool.server", "carpool.economics", "carpool.bench", "carpool.cli", "carpool.llm"),
    # The model runner (engine) sets attention metadata that models read: attention lives with the models.
    "models": ("carpool.engine", "carpool.server", "carpool.economics", "carpool.bench", "carpool.llm"),
    "kernels": (
        "carpool.models",
        "carpool.engine",
        "carpool.server",
        "carpool.economics",
        "carpool.bench",
        "carpool.llm",
    ),
}


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_engine_models_and_kernels_import_nothing_above_them(package):
    assert offences(package, ABOVE[package]) == []


def test_the_contract_imports_nothing_from_carpool():
    assert imports(PACKAGE / "economics" / "contract.py") == set()
