"""The wheel carries the packages, the kernels and migrations, and a working `kvledger` command."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from this checkout and install it (without dependencies) into a bare folder."""
    pytest.importorskip("hatchling", reason="building the wheel offline needs hatchling (in the test extra)")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True,
    )
    [wheel] = out.glob("kvledger-*.whl")
    site = out / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, capture_output=True,
    )
    return site


def _run_from(site: Path, *args: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KVLEDGER_")}
    environment["PYTHONPATH"] = str(site)
    return subprocess.run(args, cwd=site.parent, env=environment, capture_output=True, text=True, timeout=60)


def test_the_wheel_installs_one_namespace_with_the_stages_and_data_inside(installed_wheel: Path) -> None:
    [wheel] = installed_wheel.parent.glob("kvledger-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/", 1)[0] for name in names}
    assert top_level == {"kvledger", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top_level
    for stage in ("ingest", "store", "decide"):  # every source file of the stage's folder, under kvledger/
        shipped = {name for name in names if name.startswith(f"kvledger/{stage}/") and name.endswith(".py")}
        assert shipped == {f"kvledger/{path.relative_to(REPO).as_posix()}" for path in (REPO / stage).rglob("*.py")}
    shipped_cuda = {n for n in names if n.startswith("kvledger/_data/cuda/")}
    assert shipped_cuda == {f"kvledger/_data/cuda/{p.name}" for p in (REPO / "cuda").iterdir() if p.is_file()}
    assert any(n.startswith("kvledger/_data/migrations/") for n in names)
    assert not any(n.startswith("cuda/") for n in names), "cuda/ must not become an importable package"


def test_the_installed_wheel_finds_its_data_and_runs_config_show(installed_wheel: Path) -> None:
    located = _run_from(
        installed_wheel, sys.executable, "-c",
        "import kvledger, kvledger.runtime.resources as r; print(kvledger.__file__); print(r.data_dir('cuda')); print(r.data_dir('migrations'))",
    )
    assert located.returncode == 0, located.stderr
    package_file, cuda_dir, migrations_dir = located.stdout.split()
    assert Path(package_file).is_relative_to(installed_wheel)
    assert Path(cuda_dir) == installed_wheel / "kvledger" / "_data" / "cuda"
    assert Path(migrations_dir) == installed_wheel / "kvledger" / "_data" / "migrations"

    stages = _run_from(installed_wheel, sys.executable, "-c",
                       "import kvledger.ingest.bridge, kvledger.store.projector, kvledger.decide.serving.service, sys; "
                       "print(sorted(name for name in sys.modules if name.split('.')[0] in ('ingest', 'store', 'decide')))")
    assert stages.returncode == 0, stages.stderr
    assert stages.stdout.strip() == "[]"  # nothing imported under a bare stage name

    shown = _run_from(installed_wheel, str(installed_wheel / "bin" / "kvledger"), "config", "show")
    assert shown.returncode == 0, shown.stderr
    assert "reuse.minimum_transfer_prefix_blocks" in shown.stdout
    assert "default" in shown.stdout

    bad = installed_wheel.parent / "bad.toml"
    bad.write_text("a = 1\nb = 2\n")
    refused = _run_from(installed_wheel, str(installed_wheel / "bin" / "kvledger"), "config", "show", "--config", str(bad))
    assert refused.returncode == 2
    assert "unknown setting(s): ['a', 'b']" in refused.stderr


def test_an_editable_checkout_finds_data_at_the_repository_root() -> None:
    from kvledger.runtime.resources import data_dir

    if (REPO / "kvledger" / "_data").exists():
        pytest.skip("this checkout has a built _data folder")
    assert data_dir("cuda") == REPO / "cuda"
    assert data_dir("migrations") == REPO / "migrations"
