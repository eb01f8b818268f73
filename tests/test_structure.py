"""The package's shape, held as tests.

- An application with its own `protocol.py` and `supervisor.py` (names that
  the daemon's parts used to have as top-level packages) imports
  `streamfence` and streams a real call through a real daemon.
- Every package has its place in the layers (`LAYERS`): it imports only
  the packages below it, so the gateway is an ordinary client (protocol and
  config), the sink never reaches into the supervisor, no part of the
  daemon reaches the developer tools or the command line, and a new package
  fails here until it is given a place.
- No import cycle among streamfence's modules. Every import counts: at module
  level, inside a function, under `if TYPE_CHECKING:`; an import that is
  deferred into a function to dodge a cycle is the same dependency.
- No comment, docstring or string in streamfence/, scripts/ or tests/ cites
  a document that is not in the repository.
- No module of streamfence/ has more than `MAX_MODULE_LINES` lines: a module
  that grows past it is split by job.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from tests.harness import DaemonProcess
from tests.wires import profile_for, request_for

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamfence"


# ---- the import graph -------------------------------------------------------------------

@dataclass(frozen=True)
class Edge:
    target: str
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              known: dict[str, Path]) -> Iterator[str]:
    """The streamfence modules that an import statement loads by name: for
    `from X import n`, X.n when that is a module, else X itself."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        yield sub if sub in known else source


def _import_statements(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth: in functions, classes, if/try/
    with/for/while/match bodies (statements only; an expression holds none)."""
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, None) or ():
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            else:
                yield from _import_statements(child)


@functools.cache
def import_graph() -> dict[str, dict[str, Edge]]:
    """module -> {imported streamfence module -> the first line importing it}."""
    known = _modules()
    graph: dict[str, dict[str, Edge]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, Edge] = {}
        for node in _import_statements(tree):
            for target in _imported(node, module, path.name == "__init__.py", known):
                # `import streamfence.a.b` names streamfence.a.b; keep the
                # longest known prefix (a name that is not a module is an
                # attribute of it).
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != module and target not in edges:
                    edges[target] = Edge(target, node.lineno)
        graph[module] = edges
    return graph


def _where(graph: dict[str, dict[str, Edge]], path: list[str]) -> str:
    known = _modules()
    steps = []
    for a, b in itertools.pairwise(path):
        file = known[a].relative_to(ROOT)
        steps.append(f"  {a} imports {b}   ({file}:{graph[a][b].line})")
    return "\n".join(steps)


def _strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's algorithm; the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _shortest_path(graph: dict[str, dict[str, Edge]], start: str, goal: set[str],
                   within: set[str] | None = None) -> list[str] | None:
    """Breadth-first: the shortest import chain from `start` (excluded from
    `goal` at step 0) to a module in `goal`, staying in `within`."""
    frontier = [[start]]
    seen = {start}
    while frontier:
        nxt = []
        for path in frontier:
            for w in sorted(graph[path[-1]]):
                if w in goal:
                    return [*path, w]
                if w not in seen and (within is None or w in within):
                    seen.add(w)
                    nxt.append([*path, w])
        frontier = nxt
    return None


def test_the_graph_sees_module_level_and_function_level_imports() -> None:
    """The walker itself: a known module-level edge, and relative imports
    resolve (a graph without edges would make the tests below vacuous)."""
    graph = import_graph()
    assert "streamfence.protocol.client" in graph["streamfence"]
    assert "streamfence.cli" in graph["streamfence.__main__"]
    assert sum(len(e) for e in graph.values()) > 100


# Each package, bottom up, and the packages it may import (the top-level
# modules `streamfence` and `streamfence.__main__` are the faces of the
# client library and of the command line).
LAYERS: dict[str, frozenset[str]] = {
    "protocol": frozenset(),
    "cluster": frozenset({"protocol"}),
    "config": frozenset({"protocol", "cluster"}),
    "workers": frozenset({"protocol"}),
    "sink": frozenset({"protocol", "cluster"}),
    "supervisor": frozenset({"protocol", "cluster", "config", "sink", "workers"}),
    "gateway": frozenset({"protocol", "config"}),
    "devtools": frozenset({"protocol", "config"}),
    "cli": frozenset({"protocol", "cluster", "config", "sink", "supervisor", "workers",
                      "gateway", "devtools"}),
}
FACES = {"streamfence": frozenset({"protocol"}), "streamfence.__main__": frozenset({"cli"})}


def _package_of(module: str) -> str:
    return module.split(".")[1]


def test_every_package_imports_only_the_layers_below_it() -> None:
    graph = import_graph()
    problems = []
    for module in sorted(graph):
        if module in FACES:
            allowed, own = FACES[module], None
        else:
            own = _package_of(module)
            if own not in LAYERS:
                problems.append(f"{module}: package {own!r} has no place in LAYERS")
                continue
            allowed = LAYERS[own]
        for target, edge in sorted(graph[module].items()):
            theirs = _package_of(target) if target not in FACES else target
            if theirs != own and theirs not in allowed:
                file = _modules()[module].relative_to(ROOT)
                problems.append(f"{module} imports {target} ({file}:{edge.line}): "
                                f"{own or module} may import only {sorted(allowed)}")
    assert not problems, "imports across the layers:\n" + "\n".join(problems)


def test_the_layers_are_a_hierarchy() -> None:
    """No two packages may import each other, directly or not, through LAYERS."""
    def below(package: str, seen: frozenset[str] = frozenset()) -> set[str]:
        assert package not in seen, f"LAYERS has a cycle through {package}"
        out: set[str] = set()
        for lower in LAYERS[package]:
            out |= {lower} | below(lower, seen | {package})
        return out

    for package in LAYERS:
        assert package not in below(package)


def test_no_import_cycle_among_streamfence_modules() -> None:
    graph = import_graph()
    cycles = []
    for component in _strongly_connected(graph):
        members = set(component)
        start = component[0]
        path = _shortest_path(graph, start, {start}, within=members)
        assert path is not None
        others = ", ".join(m for m in component if m not in path)
        cycles.append(" -> ".join(path) + "\n" + _where(graph, path)
                      + (f"\n  (the same knot also holds: {others})" if others else ""))
    assert not cycles, "import cycles among streamfence modules:\n" + "\n".join(cycles)


# ---- no citation of documents outside the repository ------------------------------------

# Written as patterns so that this file does not cite them itself.
OUTSIDE_DOCS = [
    re.compile(r"\bSPEC\s*§", re.IGNORECASE),
    re.compile(r"\bSPEC\.md\b", re.IGNORECASE),
    re.compile(r"\borigin\s+00", re.IGNORECASE),
    re.compile(r"\bthe\s+lead\b", re.IGNORECASE),
]


def test_no_text_cites_a_document_outside_the_repository() -> None:
    hits = []
    for folder in ("streamfence", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if any(p.search(line) for p in OUTSIDE_DOCS):
                    hits.append(f"  {path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, ("text citing a document that is not in the repository (say what it "
                      "says, or cite docs/ instead):\n" + "\n".join(hits))


# ---- small modules ------------------------------------------------------------------------

MAX_MODULE_LINES = 450


def test_no_module_of_streamfence_is_longer_than_the_limit() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        count = len(path.read_text().splitlines())
        if count > MAX_MODULE_LINES:
            long.append(f"  {path.relative_to(ROOT)}: {count} lines")
    assert not long, (f"modules longer than {MAX_MODULE_LINES} lines (split each by job, "
                      "not by size):\n" + "\n".join(long))


# The methods of cluster/ledger.py that write a call's log (ARCHITECTURE §4.17, rule 3),
# and the one module outside the ledger allowed to call them: the sink's.
LOG_WRITES = {"open_epoch", "append", "_append"}
LOG_WRITER = "streamfence.sink.cluster_log"


def _log_writes(tree: ast.AST) -> Iterator[int]:
    """Lines that call a log write on something named `ledger` (`ledger.append`,
    `self.bridge.ledger.open_epoch`, ...)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in LOG_WRITES:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if "ledger" in name.lower() or node.func.attr == "open_epoch":
                yield node.lineno


def test_the_sink_is_the_only_writer_of_a_calls_log() -> None:
    """One writer per call log: no module but the sink's cluster log appends to
    it (the supervisor only decides ownership, by compare-and-set)."""
    found = {name: list(_log_writes(ast.parse(path.read_text())))
             for name, path in _modules().items()}
    assert found[LOG_WRITER], "the check no longer sees the sink's own appends"
    others = [f"  {name}:{line}" for name, lines in found.items()
              if name not in (LOG_WRITER, "streamfence.cluster.ledger") for line in lines]
    assert not others, "calls' logs written outside the sink:\n" + "\n".join(others)


# ---- an application with its own protocol.py and supervisor.py -------------------------

APP_MODULE = '''\
"""The application's own {name} module: it must never be imported by streamfence."""
import os
import sys

if os.environ.get("STREAMFENCE_TEST_APP") != "1":
    raise ImportError(f"{{__file__}} was imported by a process that is not the application: "
                      f"{{sys.argv}}")
NAME = "application {name}"
'''

APP_MAIN = '''\
import json
import sys

from streamfence import Client

# streamfence loaded no top-level module of these names ...
before = sorted(m for m in ("protocol", "supervisor") if m in sys.modules)

import protocol  # ... and the application's own are the ones found
import supervisor

endpoint, request = sys.argv[1], json.loads(sys.argv[2])
with Client(endpoint, timeout_s=10.0) as client:
    stream = client.stream_text("emu", request, session_id="app", timeout_s=30.0)
    text = "".join(stream)
print(json.dumps({"path0": sys.path[0], "before": before, "text": text,
                  "protocol": protocol.NAME, "supervisor": supervisor.NAME,
                  "status": stream.done["status"]}))
'''


@pytest.mark.slow
def test_an_application_with_its_own_protocol_and_supervisor_modules_streams_a_call(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient) -> None:
    app = tmp_path / "app"
    app.mkdir()
    for name in ("protocol", "supervisor"):
        (app / f"{name}.py").write_text(APP_MODULE.format(name=name))
    (app / "main.py").write_text(APP_MAIN)
    # The daemon runs in the application's directory too: `python -m` puts
    # it first on the daemon's sys.path, so a stray top-level import of
    # `protocol` or `supervisor` in the daemon would load the application's
    # module, which refuses (above) and stops the daemon.
    daemon = DaemonProcess(tmp_path / "state",
                           {"emu": dict(profile_for("openai", emulator), stale_timeout_s=30.0)},
                           cwd=app)
    env = dict(os.environ, STREAMFENCE_TEST_APP="1")
    env.pop("PYTHONPATH", None)
    with daemon:
        # As an application would: credentials named by the environment.
        env["STREAMFENCE_CREDENTIALS"] = str(daemon.credentials_path)
        proc = subprocess.run(
            [sys.executable, "main.py", daemon.endpoint,
             json.dumps(request_for("openai", "app", "hello from the application"))],
            cwd=app, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"the application failed:\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["path0"]).resolve() == app.resolve()
    assert out["before"] == []
    assert (out["protocol"], out["supervisor"]) == ("application protocol",
                                                    "application supervisor")
    assert out["status"] == "completed"
    sent = emu.log("app")
    assert len(sent) == 1
    assert out["text"] == sent[0]["text"] and out["text"]
    assert "was imported by a process that is not the application" not in daemon.log_text()


def test_the_cycle_finder_on_a_hand_built_graph() -> None:
    graph = {"a": {"b": Edge("b", 1)}, "b": {"c": Edge("c", 2)}, "c": {"a": Edge("a", 3)},
             "d": {"a": Edge("a", 4)}, "e": {}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _shortest_path(graph, "a", {"a"}, within={"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert _shortest_path(graph, "d", {"c"}) == ["d", "a", "b", "c"]
    assert _shortest_path(graph, "e", {"a"}) is None
