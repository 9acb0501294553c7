"""The layering docs/core.md states, checked on the source: which tier may import which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("ingest", "store", "decide")
CORE_FOLDER = ROOT / "kvledger" / "core"
CORE = tuple(sorted(path.stem for path in CORE_FOLDER.glob("*.py") if path.stem != "__init__"))


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in ("kvledger", "kvledger.core"):  # `from kvledger.core import cost` imports a module
                modules.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                modules.add(node.module)
    return modules


def first_party(modules: set[str]) -> set[str]:
    return {module for module in modules if module.split(".")[0] == "kvledger"}


def stage_of(module: str) -> str | None:
    """The stage a module belongs to (`kvledger.store.tables` → "store"), None for the core and the rest."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_only_the_core(name: str) -> None:
    imported = first_party(imported_modules(CORE_FOLDER / f"{name}.py"))
    outside = {module for module in imported if not module.startswith("kvledger.core.") or module.split(".")[2] not in CORE}
    assert outside == set(), f"kvledger/core/{name}.py imports {sorted(outside)}"


def test_nothing_in_the_core_folder_imports_a_stage_or_anything_beside_the_core() -> None:
    # The layers are the folders: kvledger/core/ is the core, whole.
    assert sorted(path.name for path in CORE_FOLDER.iterdir() if path.is_dir() and path.name != "__pycache__") == []
    for path in sources("kvledger/core"):
        bad = {m for m in first_party(imported_modules(path)) if not m.startswith("kvledger.core")}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_core_opens_no_sockets_processes_or_sql() -> None:
    worldly = {"socket", "subprocess", "asyncio", "nats", "zmq", "sqlalchemy", "aiohttp", "multiprocessing"}
    found = {name: sorted(imported_modules(CORE_FOLDER / f"{name}.py") & worldly) for name in CORE}
    assert {name: modules for name, modules in found.items() if modules} == {}


def test_the_runtime_imports_no_stage_no_app_and_no_simulator() -> None:
    for path in sources("kvledger/runtime"):
        bad = {m for m in first_party(imported_modules(path)) if stage_of(m) or m.startswith(("kvledger.app", "kvledger.sim"))}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_no_other_stage_nor_the_app_nor_the_simulator(stage: str) -> None:
    for path in sources(stage):
        bad = {m for m in first_party(imported_modules(path))
               if (stage_of(m) not in (None, stage)) or m.startswith(("kvledger.app", "kvledger.sim"))}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_client_the_engine_side_and_the_simulator_import_no_stage_but_ingest_s_engine_formats() -> None:
    # The engine side (the publisher, the TensorRT-LLM forwarder) and the simulator speak what ingest
    # reads: the engines' framing and their endpoint convention.
    engine_formats = {"kvledger.ingest.wire", "kvledger.ingest.endpoints"}
    for path in [ROOT / "kvledger" / "client.py", *sources("kvledger/sim"), *sources("kvledger/engines")]:
        bad = {m for m in first_party(imported_modules(path))
               if (stage_of(m) and m not in engine_formats) or m.startswith("kvledger.app")}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_testing_module_imports_no_stage_no_app_and_no_simulator() -> None:
    # kvledger.testing runs kvledger's image for users' own tests: it speaks to the services
    # over NATS, HTTP and SQL, as a router would, and never through a stage's code.
    for path in sources("kvledger/testing"):
        bad = {m for m in first_party(imported_modules(path)) if stage_of(m) or m.startswith(("kvledger.app", "kvledger.sim"))}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def _index_reads(path: Path) -> set[str]:
    """The attributes a module reads off the index: of a name `index`, or of anything's `.index`."""
    reads = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            held = node.value
            if (isinstance(held, ast.Name) and held.id == "index") or (isinstance(held, ast.Attribute) and held.attr == "index"):
                reads.add(node.attr)
    return reads


def test_the_index_is_read_through_its_view_outside_its_room() -> None:
    # The index's arrays and workers as the kernels take them (decide/inventory/view.py); its compact
    # store, its fold and how workers move between them stay inside decide/inventory/.
    from kvledger.decide.inventory.view import READER_NAMES, WRITER_NAMES

    writers = {ROOT / "decide" / "serving" / "service.py", ROOT / "decide" / "ranking" / "whatif.py"}
    readers = [path for path in [*sources("decide"), *sources("bench"), *sources("kvledger")]
               if not path.is_relative_to(ROOT / "decide" / "inventory")]
    assert readers
    for path in readers:
        allowed = WRITER_NAMES if path in writers or path.is_relative_to(ROOT / "bench") else READER_NAMES
        assert _index_reads(path) <= allowed, f"{path.relative_to(ROOT)} reads {sorted(_index_reads(path) - allowed)}"


def test_no_module_imports_itself_back_in_a_circle() -> None:
    # kvledger's own modules, as a graph of every import they make (a function's lazy ones too): no cycles.
    def module_of(path: Path) -> str:
        relative = path.relative_to(ROOT).with_suffix("")
        parts = relative.parts if relative.parts[0] == "kvledger" else ("kvledger", *relative.parts)
        return ".".join(parts).removesuffix(".__init__")

    paths = [*sources("kvledger"), *(path for stage in STAGES for path in sources(stage))]
    known = {module_of(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # a function's import too
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                imported |= {name for name in names if name in known} or ({node.module} & known.keys())
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names} & known.keys()
        graph[module] = imported - {module}
    visiting, done, circles = set(), set(), []

    def visit(module: str, trail: list[str]) -> None:
        if module in done:
            return
        if module in visiting:
            circles.append(trail[trail.index(module):] + [module])
            return
        visiting.add(module)
        for other in sorted(graph[module]):
            visit(other, [*trail, module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert circles == []
