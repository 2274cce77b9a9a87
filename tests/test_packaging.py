"""The distribution: it is named ``zephon-loader`` everywhere a user reads it (and imported as
``zephon``), the sdist carries the sources and nothing generated, a wheel builds from that sdist
alone, and the wheel installs into a fresh virtual environment, ships its type information,
imports, runs the documentation's quick start and the ``zephon`` command.

Builds use ``python -m build`` with build isolation, so the build dependencies come from the
package index (network access needed). The whole module takes a few minutes; the builds are shared
between its tests through module-scoped fixtures.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path, PurePosixPath

import pytest

import zephon
from zephon.cli import DISTRIBUTION

REPO = Path(__file__).resolve().parents[1]
# File names normalize the distribution name (PEP 625 / wheel): zephon-loader -> zephon_loader.
FILE_STEM = DISTRIBUTION.replace("-", "_")
CORE = REPO / "zephon" / "_core"
KERNELS = sorted(p.stem for p in CORE.glob("*.pyx"))
GENERATED = (".c", ".cpp", ".so", ".pyd", ".o", ".html")


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise AssertionError(
            f"{' '.join(map(str, args))} failed ({result.returncode}) in {cwd}:\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result.stdout


def _build(*args: str | Path, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEPHON_")}  # a plain build
    _run(sys.executable, "-m", "build", *args, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def build_frontend() -> None:
    """``python -m build``: installed into the running environment once if it is missing."""
    if importlib.util.find_spec("build") is None:
        _run(sys.executable, "-m", "pip", "install", "-q", "build", cwd=REPO)


#: What a checkout holds that no build reads (environments, caches, build directories).
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "build", "_build", ".mypy_cache", ".ruff_cache", ".hypothesis", ".asv"
)


@pytest.fixture(scope="module")
def sdist(build_frontend: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of the checkout, its generated files included (the sdist must leave them
    # out): the build regenerates C files with its own Cython, and must not do so in the checkout.
    tree = tmp_path_factory.mktemp("checkout") / "zephon"
    shutil.copytree(REPO, tree, ignore=_NOT_COPIED, symlinks=True)
    out = tmp_path_factory.mktemp("sdist")
    _build("--sdist", "--outdir", out, tree, cwd=tree)
    (path,) = out.glob(f"{FILE_STEM}-*.tar.gz")
    return path


@pytest.fixture(scope="module")
def sdist_names(sdist: Path) -> set[str]:
    """The sdist's member paths, relative to its top directory."""
    with tarfile.open(sdist) as tar:
        return {str(PurePosixPath(*PurePosixPath(m.name).parts[1:])) for m in tar.getmembers()}


@pytest.fixture(scope="module")
def wheel(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the unpacked sdist alone, as cibuildwheel does."""
    src = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(src, filter="data")
        else:
            tar.extractall(src)
    (project,) = src.iterdir()
    out = tmp_path_factory.mktemp("wheel")
    _build("--wheel", "--outdir", out, project, cwd=project)
    (path,) = out.glob(f"{FILE_STEM}-*.whl")
    return path


def test_pyproject_names_the_distribution_the_cli_reports():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION


def test_the_build_check_covers_every_kernel():
    # `import zephon` checks each listed kernel, so that a missing build fails with how to fix it.
    from zephon._core import _MODULES

    assert sorted(_MODULES) == KERNELS


def test_every_pip_install_in_the_docs_names_the_distribution():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    pages += sorted((REPO / ".github" / "workflows").glob("*.yml"))
    wrong = []
    for page in pages:
        for line in page.read_text().splitlines():
            for command in re.findall(r"pip install [^`#\n]*", line):
                # the import name alone (`pip install zephon`, "zephon[torch]") is someone else's
                if re.search(r"(?<![\w.-])zephon(?![\w-])", command):
                    wrong.append(f"{page.relative_to(REPO)}: {command.strip()}")
    assert not wrong, f"pip install names the import name, not {DISTRIBUTION}: {wrong}"
    readme = (REPO / "README.md").read_text()
    assert f"pip install {DISTRIBUTION}" in readme
    assert f'pip install "{DISTRIBUTION}[torch]"' in readme


@pytest.mark.slow
@pytest.mark.network
def test_the_sdist_holds_the_build_files_and_every_kernel_source(sdist_names: set[str]):
    expected = {
        "setup.py",
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "zephon/py.typed",
        "zephon/_core/_types.pxd",
    }
    for stem in KERNELS:
        expected |= {f"zephon/_core/{stem}.{ext}" for ext in ("pyx", "pyi")}
    expected |= {f"zephon/_core/{p.name}" for p in CORE.glob("*.pxd")}
    missing = sorted(expected - sdist_names)
    assert not missing, f"missing from the sdist: {missing}"


@pytest.mark.slow
@pytest.mark.network
def test_the_sdist_holds_no_generated_files(sdist_names: set[str]):
    generated = sorted(n for n in sdist_names if n.endswith(GENERATED))
    assert not generated, (
        f"generated files in the sdist: {generated}; exclude them in MANIFEST.in "
        "(wheels must cythonize the .pyx sources)"
    )


@pytest.mark.slow
@pytest.mark.network
def test_the_wheel_ships_compiled_kernels_stubs_and_py_typed(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(zf.namelist())
    listing = "\n  ".join(names)
    assert "zephon/py.typed" in names, f"no py.typed in the wheel:\n  {listing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), (
        f"no LICENSE:\n  {listing}"
    )
    for stem in KERNELS:
        assert f"zephon/_core/{stem}.pyi" in names, f"no stub for {stem}:\n  {listing}"
        compiled = [
            n
            for n in names
            if n.startswith(f"zephon/_core/{stem}.") and n.endswith((".so", ".pyd"))
        ]
        assert len(compiled) == 1, f"no compiled module for {stem}:\n  {listing}"
    generated_c = [n for n in names if n.endswith((".c", ".cpp"))]
    assert not generated_c, f"generated C sources in the wheel: {generated_c}"


SMOKE = textwrap.dedent(
    """
    import sys

    import zephon
    import zephon._core.cursor
    from zephon.types import SampleCursor

    assert zephon.__file__.startswith(sys.prefix), zephon.__file__  # the wheel, not the checkout
    assert "torch" not in sys.modules, "import zephon must not import torch"
    cursor = SampleCursor(7, 2, (0, 5, 42)).child(1)
    assert repr(cursor) == "SampleCursor(7, 2, (0, 5, 42), lineage=(1,))", repr(cursor)
    assert cursor.sort_key == (7, 2, (1,), (0, 5, 42))
    print("zephon", zephon.__version__, "from", zephon.__file__)
    """
)


@pytest.mark.slow
@pytest.mark.network
def test_the_wheel_installs_imports_and_runs_the_quick_start_in_a_fresh_venv(
    wheel: Path, tmp_path: Path
):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    _run(python, "-m", "pip", "install", "-q", wheel, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    work = tmp_path / "work"  # outside the checkout, so only the installed wheel can be imported
    work.mkdir()
    (work / "smoke.py").write_text(SMOKE)
    assert "from" in _run(python, "-I", "smoke.py", cwd=work, env=env)
    quick_start = REPO / "docs" / "examples" / "quickstart.py"
    _run(python, "-I", quick_start, cwd=work, env=env)
    assert (work / "loader.json").is_file(), "the quick start saves its checkpoint in the cwd"
    metadata = (
        "import importlib.metadata as m; "
        f"print(m.version({DISTRIBUTION!r}), m.packages_distributions()['zephon'])"
    )
    assert _run(python, "-I", "-c", metadata, cwd=work, env=env).split() == [
        zephon.__version__,
        f"[{DISTRIBUTION!r}]",
    ]
    command = env_dir / ("Scripts" if os.name == "nt" else "bin") / "zephon"
    version = _run(command, "--version", cwd=work, env=env).strip()
    assert version == f"{DISTRIBUTION} {zephon.__version__}"
    assert "Zephon loader state" in _run(command, "inspect", "loader.json", cwd=work, env=env)
    # `zephon bench`'s workloads ship in the wheel: it needs no source checkout.
    _run(python, "-I", "-c", "import zephon.bench.report", cwd=work, env=env)
