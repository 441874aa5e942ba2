"""The software a result was made with, recorded beside it (`--json` files, `checkpoint.json`): timings and
numerics from different torch, triton or transformers releases are not comparable without it."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

import kv4rl


def package_version(name: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str]:
    """kv4rl's, Python's and the installed torch / triton / transformers releases (and torch's CUDA, when
    torch is loaded and built with it)."""
    versions = {"kv4rl": kv4rl.__version__, "python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        found = package_version(name)
        if found is not None:
            versions[name] = found
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        versions["cuda"] = cuda
    return versions


def stamped(result: dict) -> dict:
    """`result` with `versions` (`software_versions`) added where it has none: every --json result's record."""
    return result if "versions" in result else {**result, "versions": software_versions()}
