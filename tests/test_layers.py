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


def test_the_client_and_the_simulator_import_no_stage_but_ingest_s_engine_formats() -> None:
    # The simulator speaks what ingest reads: the engines' framing and their endpoint convention.
    engine_formats = {"kvledger.ingest.wire", "kvledger.ingest.endpoints"}
    for path in [ROOT / "kvledger" / "client.py", *sources("kvledger/sim")]:
        bad = {m for m in first_party(imported_modules(path))
               if (stage_of(m) and m not in engine_formats) or m.startswith("kvledger.app")}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_testing_module_imports_no_stage_no_app_and_no_simulator() -> None:
    # kvledger.testing runs kvledger's image for users' own tests: it speaks to the services
    # over NATS, HTTP and SQL, as a router would, and never through a stage's code.
    for path in sources("kvledger/testing"):
        bad = {m for m in first_party(imported_modules(path)) if stage_of(m) or m.startswith(("kvledger.app", "kvledger.sim"))}
        assert bad == set(), f"{path.relative_to(ROOT)} imports {sorted(bad)}"
