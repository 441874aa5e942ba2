"""What a user gets who installs kv4rl from its sdist or wheel rather than a checkout (QA: the sdist carried
tests that could not import their helpers, and no recipes or docs; the wheel no PEP 561 marker)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import kv4rl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="needs the source tree")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[list[str], list[str]]:
    """(the sdist's file names, the wheel's), built from a copy of the tree (the build writes build/ and
    egg-info beside the sources)."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tree / name)
    for name in ("src", "tests", "recipes", "docs"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    dist = tree / "dist"
    script = ("import setuptools.build_meta as b, sys; d = sys.argv[1]; "
              "s = b.build_sdist(d); w = b.build_wheel(d); print('built', s, w)")
    out = subprocess.run([sys.executable, "-c", script, str(dist)], cwd=tree, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    sdist, wheel = next(line.split()[1:] for line in out.splitlines() if line.startswith("built "))
    with tarfile.open(dist / sdist) as tar:
        sdist_names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    return sdist_names, zipfile.ZipFile(dist / wheel).namelist()


def test_the_sdist_carries_the_test_helpers_recipes_and_docs(built):
    sdist, _ = built
    tracked = {p.relative_to(ROOT).as_posix() for d in ("tests", "recipes", "docs") for p in (ROOT / d).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    missing = sorted(tracked - set(sdist))
    assert not missing, missing


def test_the_wheel_carries_every_source_file_the_kernels_and_the_typing_marker(built):
    _, wheel = built
    sources = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "kv4rl").rglob("*")
               if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".typed") and "__pycache__" not in p.parts}
    assert "kv4rl/py.typed" in sources
    assert sorted(sources - set(wheel)) == []
    assert not any(name.startswith(("tests/", "recipes/")) for name in wheel)


def test_the_version_is_one_number():
    """`kv4rl.__version__` (what `--version`, checkpoint.json and every --json record) is pyproject's."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == kv4rl.__version__
