"""docs/ARCHITECTURE.md's claims about the code, held as tests.

Each test reads the source (ast, text), starts no process, and names in its
docstring the section whose claim it holds. The kinds of drift they catch
are the ones a review found: a path or class that moved, a message the
table lost or kept after it was removed, a tag built or parsed outside its
conversation's module, an import that reaches into another process's
package.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from tests.test_structure import LAYERS, import_graph

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamfence"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
INTERNAL = PACKAGE / "protocol" / "internal" / "__init__.py"


@functools.cache
def _doc() -> str:
    return DOC.read_text()


def _section(number: str) -> str:
    """The text of section `number` ("3", "5") up to the next section of its level."""
    text = _doc()
    start = re.search(rf"^## {re.escape(number)}\. .*$", text, re.MULTILINE)
    assert start is not None, f"ARCHITECTURE has no section {number}"
    end = re.search(r"^## \d", text[start.end():], re.MULTILINE)
    return text[start.end():start.end() + end.start()] if end else text[start.end():]


def _resolve(path: str) -> Path:
    """A path as the doc writes it: under streamfence/, or from the repository's
    root for the folders outside the package."""
    if path.split("/")[0] in ("tests", "scripts", "contrib", "docs"):
        return ROOT / path
    return PACKAGE / path


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _defines(path: Path, name: str) -> bool:
    """`name` (or `Class.member`) is defined at the top level of `path`."""
    head, _, member = name.partition(".")
    for node in _tree(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name == head:
            if not member:
                return True
            return isinstance(node, ast.ClassDef) and any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member
                for n in node.body)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and not member:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == head for t in targets):
                return True
    return False


def test_every_path_the_architecture_names_exists() -> None:
    """ARCHITECTURE (all sections, §5 above all): every `path.py` and `dir/`
    it names in backticks exists."""
    tokens = sorted(set(re.findall(r"`([\w./-]+(?:\.py|/))`", _doc())))
    missing = [t for t in tokens if ("/" in t.rstrip("/") or t.endswith(".py"))
               and not _resolve(t).exists()]
    assert not missing, f"ARCHITECTURE names paths that do not exist: {missing}"


# `path.py` followed by the names it defines in parentheses: `a.py` (`A`, `B`: why)
_MODULE_WITH_NAMES = re.compile(r"`([\w/]+\.py)` \(((?:`[\w.]+`(?:, |: [^)]*)?)+)\)")


def test_each_name_in_where_things_live_is_defined_in_its_module() -> None:
    """ARCHITECTURE §5 (and every "`module.py` (`Name`)" elsewhere): the
    classes and functions named beside a module are defined in it."""
    wrong = []
    pairs = _MODULE_WITH_NAMES.findall(_doc())
    assert len(pairs) > 40, "the pattern found too few module (`Name`) pairs"
    for path, names in pairs:
        for name in re.findall(r"`([\w.]+)`", names):
            if not _defines(_resolve(path), name):
                wrong.append(f"{path}: {name}")
    assert not wrong, f"names ARCHITECTURE puts in modules that do not define them: {wrong}"


# Each process and the one entry §1 names (module, function or Class.method).
ENTRIES = {
    "supervisor": ("supervisor/daemon.py", "Daemon.run"),
    "sink": ("sink/process.py", "run_sink"),
    "zygote": ("workers/zygote_entry.py", "zygote_main"),
    "worker": ("workers/worker.py", "worker_main"),
    "gateway": ("gateway/process.py", "run_gateway"),
}


def test_each_process_has_the_entry_the_doc_names() -> None:
    """ARCHITECTURE §1: each process's entry exists where the table says, the
    table names it, and no other function is a process target."""
    table = _section("1")
    for process, (path, name) in ENTRIES.items():
        assert _defines(_resolve(path), name), f"{process}: {path} has no {name}"
        assert f"`{path}` `{name}`" in table, f"§1's table does not name {process}'s entry"
    # Every `Process(target=...)` in the daemon starts one of these entries.
    targets = set()
    for source in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "Process":
                for kw in node.keywords:
                    if kw.arg == "target" and isinstance(kw.value, ast.Name):
                        targets.add(kw.value.id)
    assert targets <= {name for _, name in ENTRIES.values()}, targets
    assert targets, "found no Process(target=...) at all"


def test_the_supervisor_imports_neither_the_gateway_nor_the_sdks() -> None:
    """ARCHITECTURE §1, §4.13, §5: the gateway's entry is handed in (the
    supervisor never imports the gateway), and of `workers` the supervisor
    imports only the liveness table and the zygote's entry, which imports
    nothing of streamfence at its top (the spawned child imports the SDKs)."""
    graph = import_graph()
    reached = {target for module, edges in graph.items()
               if module.startswith("streamfence.supervisor") for target in edges}
    assert not {m for m in reached if m.startswith("streamfence.gateway")}
    assert {m for m in reached if m.startswith("streamfence.workers")} == {
        "streamfence.workers.liveness", "streamfence.workers.zygote_entry"}
    entry = _tree(PACKAGE / "workers" / "zygote_entry.py")
    top_level = [n for n in entry.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module in ("__future__", "typing")
               for n in top_level), "zygote_entry.py imports more than typing at its top"


def _tags() -> set[str]:
    """The message tags `protocol/internal/__init__.py` defines."""
    out = set()
    for node in _tree(INTERNAL).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, int):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def test_the_internal_wire_table_names_every_tag_and_no_other() -> None:
    """ARCHITECTURE §3: the table lists every message tag the code defines,
    and none that it does not (a removed W_EXIT, a missing C_ADOPT)."""
    named = set(re.findall(r"`([TCREWL]_[A-Z_]+)`", _section("3")))
    defined = _tags()
    assert len(defined) > 15
    assert named == defined, (f"in §3 but not defined: {sorted(named - defined)}; "
                              f"defined but not in §3: {sorted(defined - named)}")


# Where each conversation's tags may be used: its module, and the exceptions §3 names.
TAG_HOMES = {
    "T_": {"protocol.internal.worker_wire"},
    "C_": {"protocol.internal.control"}, "R_": {"protocol.internal.control"},
    "E_": {"protocol.internal.control"},
    "W_": {"protocol.internal.workers"},
    "L_": {"protocol.logs", "supervisor.logs"},
}
# The sink's per-delta loop checks T_DELTA inline and dispatches T_HELLO (§3).
TAG_EXCEPTIONS = {("sink.intake", "T_DELTA"), ("sink.intake", "T_HELLO")}


def test_each_tag_is_used_only_in_its_conversation_module() -> None:
    """ARCHITECTURE §3: "each message has one builder and one parser in the
    module of its conversation": a tag is imported only there (the sink's
    inline T_DELTA check in sink/intake.py is the one named exception)."""
    tags = _tags()
    stray = []
    for source in sorted(PACKAGE.rglob("*.py")):
        if source == INTERNAL:
            continue
        module = ".".join(source.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.walk(_tree(source)):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module == "streamfence.protocol.internal":
                names = [a.name for a in node.names if a.name in tags]
            elif isinstance(node, ast.Attribute) and node.attr in tags:
                names = [node.attr]
            for tag in names:
                if module not in TAG_HOMES[tag[:2]] and (module, tag) not in TAG_EXCEPTIONS:
                    stray.append(f"{module}: {tag}")
    assert not stray, f"tags used outside their conversation's module: {stray}"


def test_outside_the_sink_only_its_transcript_and_entry_are_imported() -> None:
    """ARCHITECTURE §5: other packages read the transcript through
    sink/transcript.py alone, and start the sink through sink/process.py."""
    graph = import_graph()
    allowed = {"streamfence.sink.transcript", "streamfence.sink.process"}
    reached = {(module, target) for module, edges in graph.items()
               if not module.startswith("streamfence.sink") for target in edges
               if target.startswith("streamfence.sink")}
    assert {target for _, target in reached} <= allowed, sorted(
        pair for pair in reached if pair[1] not in allowed)


def test_the_layers_the_doc_gives_are_the_ones_tested() -> None:
    """ARCHITECTURE §5: the layering paragraph says what LAYERS says."""
    text = " ".join(_section("5").split("| concern")[0].split())
    found = re.search(r"Layers \(.*?\): (.*?)\. Outside", text)
    assert found is not None, "§5 lost its layering sentence"
    said: dict[str, frozenset[str]] = {}
    for entry in found.group(1).split("; "):
        package, _, rest = entry.strip("`").partition("` ")
        if rest == "nothing of ours":
            said[package] = frozenset()
        elif rest == "every package":
            said[package] = frozenset(LAYERS) - {package}
        else:
            said[package] = frozenset(rest.split(", "))
    assert said == dict(LAYERS)
