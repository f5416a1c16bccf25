"""The import rules of ARCHITECTURE.md, read from the source with ``ast``: which package may import
which, and no import cycle between modules. Every import counts, lazy and type-only ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("protocol", "modelopt_fp8", "service", "engine_client", "weight_cache_cli")
PACKAGES = (*PRODUCT, "harness", "tests", "bench")
# What each package may import of the project, besides itself.
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "modelopt_fp8": {"protocol"},
    "service": {"protocol", "modelopt_fp8"},
    "engine_client": {"protocol", "modelopt_fp8"},
    "weight_cache_cli": {"protocol", "modelopt_fp8", "service", "engine_client"},
    # What the tests and the benchmarks run the product with; neither imports the other.
    "harness": set(PRODUCT),
    "tests": {*PRODUCT, "harness"},
    "bench": {*PRODUCT, "harness"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "fixtures" not in path.relative_to(ROOT).parts  # generated checkpoints' scripts
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts ``a.b`` when that is a
    module, else ``a``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in known else base for t in targets]
        for target in targets:
            module = target
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module and module != name:
                found.add(module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _forbidden(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if (top := target.split(".")[0]) != module.split(".")[0]
        and top not in ALLOWED[module.split(".")[0]]
    )


def test_packages_import_only_what_they_may() -> None:
    assert _forbidden(_graph()) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"bench.lease": {"tests.waiting"}}, ["bench.lease imports tests.waiting"]),
        ({"tests.x": {"bench.common"}}, ["tests.x imports bench.common"]),
        ({"harness.y": {"tests.conftest"}}, ["harness.y imports tests.conftest"]),
        (
            {"service.daemon": {"engine_client.client"}},
            ["service.daemon imports engine_client.client"],
        ),
        ({"bench.lease": {"harness.waiting", "service.daemon"}}, []),
    ],
)
def test_the_import_rule_sees_an_upward_import(
    graph: dict[str, set[str]], expected: list[str]
) -> None:
    assert _forbidden(graph) == expected


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exporting its modules is not a cycle with them: drop the edges
    from a module to the ``__init__`` of a package that contains it."""
    return {
        module: {t for t in targets if not module.startswith(t + ".")}
        for module, targets in graph.items()
    }


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(_without_package_inits(_graph())) == []


def test_no_import_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        top = module.split(".")[0]
        packages.setdefault(top, set()).update(t.split(".")[0] for t in targets)
    for top, targets in packages.items():
        targets.discard(top)
    assert _cycles(packages) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_check_sees_a_cycle(
    graph: dict[str, set[str]], expected: list[list[str]]
) -> None:
    assert _cycles(graph) == expected


def _daemon_internals_reached(source: str, where: str) -> list[str]:
    """Every ``<...>daemon.metrics`` or ``<...>daemon.settings`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if not isinstance(node, ast.Attribute) or node.attr not in ("metrics", "settings"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if name == "daemon":
            found.append(f"{where}:{node.lineno} daemon.{node.attr}")
    return found


def test_the_api_talks_to_the_daemon_through_its_methods() -> None:
    """Routes, auth and handlers call the daemon's methods: they reach neither its settings nor
    its metrics (ARCHITECTURE.md)."""
    reached = [
        hit
        for path in sorted((ROOT / "service" / "api").rglob("*.py"))
        for hit in _daemon_internals_reached(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert reached == []


def test_the_daemon_internals_check_sees_a_reach() -> None:
    source = "def f(request, daemon):\n    return request.app.state.daemon.metrics, daemon.settings"
    assert _daemon_internals_reached(source, "r.py") == [
        "r.py:2 daemon.metrics",
        "r.py:2 daemon.settings",
    ]


def test_test_files_are_named_uniquely() -> None:
    """One name, one file: a test named in a report or a traceback is found without its path."""
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_every_module_logs_through_the_escaping_logger() -> None:
    """Log records carry what clients and checkpoints say: every module's logger escapes
    control characters (``protocol.logsafe.get_logger``); only the logging set-up itself names
    loggers by ``logging.getLogger``: the daemon's, and inside an engine the hand-over of the
    project's loggers to vLLM's (``engine_client/vllm/internals.py``)."""
    allowed = {
        ROOT / "protocol" / "logsafe.py",
        ROOT / "service" / "logs.py",
        ROOT / "engine_client" / "vllm" / "internals.py",
    }
    plain = [
        str(path.relative_to(ROOT))
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in allowed and "logging.getLogger(" in path.read_text()
    ]
    assert plain == []
