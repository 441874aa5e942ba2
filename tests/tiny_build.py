"""The tiny model's real build for tests/test_tiny_model.py, in a child process that conftest starts as
soon as the tests are collected.

The build (~45 s) runs on one thread (`kv4rl.models.tiny.BUILD_THREADS`), and the tests collected before
test_tiny_model mostly keep one of CI's two cores busy, so the build runs beside them instead of holding
up the suite when test_tiny_model's fixture needs it. The child makes the same call the fixture made in
its own process, `tiny_model_dir(cache)`, and records around that call whether it left the caller's RNG
state and thread count as they were.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import json, sys
import torch
from kv4rl.models import tiny
rng_before = torch.random.get_rng_state()
torch.set_num_threads(3)  # not the build's own 1, whatever OMP_NUM_THREADS the tests run under (xdist: 1)
threads_before = torch.get_num_threads()
path = tiny.tiny_model_dir(sys.argv[1], progress=False)
print(json.dumps({"path": str(path), "rng_untouched": torch.equal(rng_before, torch.random.get_rng_state()),
                  "threads_untouched": torch.get_num_threads() == threads_before}))
"""


class TinyBuild:
    """`tiny_model_dir(cache)` running in a child process; `result()` waits for it."""

    def __init__(self, cache: Path, logs: Path):
        self.cache = cache
        self._stdout, self._stderr = logs / "stdout.txt", logs / "stderr.txt"
        with self._stdout.open("w") as out, self._stderr.open("w") as err:
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(cache)], stdout=out, stderr=err)

    def result(self, timeout: float = 1200) -> dict:
        """{"cache", "path", "rng_untouched", "threads_untouched"}, as the fixture returned them."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert self._proc.returncode == 0, f"building the tiny model failed:\n{self._stderr.read_text()[-5000:]}"
        out = json.loads(self._stdout.read_text().splitlines()[-1])
        return {"cache": self.cache, **out, "path": Path(out["path"])}

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


STARTED = pytest.StashKey[TinyBuild]()


def start(base: Path) -> TinyBuild:
    """The build into `base/kv4rl_cache`, its output in `base/kv4rl_cache_build`."""
    (base / "kv4rl_cache").mkdir(parents=True)
    (base / "kv4rl_cache_build").mkdir()
    return TinyBuild(base / "kv4rl_cache", base / "kv4rl_cache_build")
