"""Shared fixtures: random tiny HF checkpoints (built in seconds, no download)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks its CPU interpreter when a kernel is defined, at the kernel module's import. The kernel test
    # modules set this at their own import, but collection imports the modules in the order given: a module that
    # imported the kernels first (`pytest tests/test_z.py tests/test_kernels.py`) left them compiled for a GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n N` (the README's command) each worker process has a core: torch's pool of threads beside
    # another worker's spins for cores it does not get (on 2 cores, a 20 s training test took 250 s). The
    # variable carries one thread to the processes the tests start (`kv4rl train`, torchrun's ranks).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The shared helpers' asserts are rewritten as test modules' are: their messages show the values, and under
# `python -O` they still check (pytest only rewrites test modules and conftest unless told).
pytest.register_assert_rewrite("tests.small_runs", "tests.tiny_build", "tests.kernel_cases", "tests.gloo_ranks")


def fresh_generator() -> torch.Generator:
    """A CPU generator on a fresh random seed, so each run tests new inputs. The seed is printed, and pytest
    shows it beside a failure; `KV4RL_TEST_SEED=<seed>` replays that run's inputs."""
    seed = int(os.environ.get("KV4RL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random inputs from seed {seed} (replay: KV4RL_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


def assert_plain_modes(folder: Path, scratch: Path) -> None:
    """`folder` and everything under it have the permission bits a plain mkdir() or open() gives a folder
    or file made in `scratch`: what this process's umask allows, no more private (safetensors writes 0600,
    `tempfile.mkdtemp` makes 0700)."""
    (scratch / "plain-folder").mkdir()
    (scratch / "plain-file").write_text("")
    want = {is_dir: stat.S_IMODE((scratch / ("plain-folder" if is_dir else "plain-file")).stat().st_mode)
            for is_dir in (True, False)}
    wrong = {str(p.relative_to(folder)): oct(stat.S_IMODE(p.stat().st_mode))
             for p in [folder, *folder.rglob("*")] if stat.S_IMODE(p.stat().st_mode) != want[p.is_dir()]}
    assert not wrong, f"{wrong}; plain folder {oct(want[True])}, plain file {oct(want[False])}"


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs for a kernel test (`fresh_generator`: the seed printed, replayable)."""
    return fresh_generator()


def make_checkpoint(path, model_type="qwen3", vocab=97, seed=0, **overrides):
    """Save a random-init tiny HF causal LM of `model_type` to `path`; returns the HF model."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[model_type]
    kwargs = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
              "eos_token_id": vocab - 1, "tie_word_embeddings": False}
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(4.0)  # sharper distributions so greedy ties are vanishingly unlikely
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    model = make_checkpoint(path)
    return path, model


@pytest.fixture(scope="session")
def gqa_hd32_ckpt(tmp_path_factory):
    """Two query heads per KV head of 32: the smallest shape the Triton kernels take (interpreter tests)."""
    path = tmp_path_factory.mktemp("hd32")
    make_checkpoint(path, head_dim=32, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    return path


@pytest.fixture(scope="session")
def gqa_hd128_ckpt(tmp_path_factory):
    """A real head shape (head_dim 128, four query heads per KV head) in three small layers (GPU tests)."""
    path = tmp_path_factory.mktemp("gqa128")
    make_checkpoint(path, vocab=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="session")
def testbed_cache(tmp_path_factory):
    """A kv4rl cache holding the `longmul-test` testbed, built once per session (a few seconds)."""
    from kv4rl.models.testbed import testbed_model_dir

    cache = tmp_path_factory.mktemp("kv4rl_testbed_cache")
    return cache, testbed_model_dir("longmul-test", cache, progress=False)


def pytest_collection_finish(session):
    """Start test_tiny_model's real build now, beside the tests that run before it (tests/tiny_build.py
    says why), when a collected test needs it. Not under xdist, whose workers would each build it: there
    the fixture starts it when it is needed."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or session.config.option.collectonly:
        return
    if any(item.path.name == "test_tiny_model.py" and "built" in getattr(item, "fixturenames", ())
           for item in session.items):
        from tests import tiny_build

        base = Path(tempfile.mkdtemp(prefix="kv4rl-tiny-build-"))
        session.config.stash[tiny_build.STARTED] = tiny_build.start(base)


def pytest_sessionfinish(session):
    from tests import tiny_build

    build = session.config.stash.get(tiny_build.STARTED, None)
    if build is not None:
        build.stop()  # a session that ends early leaves no build running
        shutil.rmtree(build.cache.parent, ignore_errors=True)  # the folder this session made for it
