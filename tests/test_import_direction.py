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
    """The server's assembly (server/assembly.py) builds the concrete gate and mounts its routes, and command lines
    (`carpool serve`'s server/cli.py takes the gate's flags, `carpool cascade` prices answers) may read it; no other
    server module knows more of economics than the contract."""
    found = offences("server", ("carpool.economics",), allowed=("carpool.economics.contract",))
    assembly = ("carpool/server/assembly.py ", "carpool/server/cli.py ", "carpool/server/cascade/cli.py ")
    assert [line for line in found if not line.startswith(assembly)] == []


def test_only_the_carpool_command_imports_the_serve_command():
    """Every way of serving (one process, `--replicas`, the Ray Serve deployment) is assembled by
    server/assembly.py; server/cli.py is the command line only, which nothing but carpool/cli.py imports."""
    found = [
        line
        for package in ("server", "deploy", "bench", "economics")
        for line in offences(package, ("carpool.server.cli",))
    ]
    assert found == []


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the carpool modules it imports}, each import resolved to the module that defines it. An import of
    the module's own package (a submodule reading its package's compiled extension) is no edge: the package's
    __init__ is what imports the submodule."""
    names = {module_name(path) for path in PACKAGE.rglob("*.py")}

    def defined_in(name: str) -> str | None:
        while name not in names and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in names else None

    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        targets = {defined_in(name) for name in imports(path)}
        graph[module] = {t for t in targets if t and t != module and not inside(module, t)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    """Imports inside functions included: a cycle there is a knot in the design even when it imports fine."""
    assert cycles(import_graph()) == []


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
