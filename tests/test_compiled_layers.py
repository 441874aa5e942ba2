"""`trainer.compile_layers`: the learner with every decoder layer compiled takes the same steps as the
eager one (fp32, CPU, FSDP2 at world size 1, ragged batches with checkpointing), keeps its parameter
names, and compiles graphs that every layer shares. The GPU path (inductor's Triton kernels, bf16,
FlexAttention) is checked by tests/gpu/test_learner_options_gpu.py and timed by `kv4rl bench learner
--compile-layers`."""

import pytest
import torch
from torch import nn

from kv4rl.config import RunConfig, TrainerConfig
from kv4rl.trainer import compiled_layers
from kv4rl.trainer.compiled_layers import compile_layers, decoder_layers
from kv4rl.trainer.batch import build_batch
from tests.test_learner_fsdp import make, ragged_batch


def test_compiled_learner_takes_the_same_steps_as_the_eager_one(tiny_qwen3, monkeypatch):
    """Dynamo's graphs through AOT autograd without inductor's code generation (its C++ kernels cost a
    minute of CI on two cores and are not the path that matters; the GPU test runs inductor)."""
    path, _ = tiny_qwen3
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests' compilations count there too
    eager = make(path, True, grad_checkpointing=True)
    compiled = make(path, True, grad_checkpointing=True, compile_layers=True)
    layers = compiled.model.config.num_hidden_layers
    assert layers >= 2 and compiled.compiled_layers == layers and eager.compiled_layers == 0
    # the layers' graphs (policy with and without grad, reference, each length class) stay compiled: dynamo's
    # default limit of 8 would leave the next ones eager, and an eager recompute fails checkpoint's check
    assert torch._dynamo.config.recompile_limit >= compiled_layers.GRAPHS_PER_LAYER_CODE > 8
    assert list(compiled.state_dict()) == list(eager.state_dict())  # compiled in place: same names
    # a ragged batch: its micro-batches of other lengths reuse the dynamic-shape graphs
    m_eager, m_compiled = eager.step(ragged_batch(1)), compiled.step(ragged_batch(1))
    assert m_compiled["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-4)
    assert m_compiled["loss"] == pytest.approx(m_eager["loss"], rel=1e-4, abs=1e-6)
    # AdamW divides each gradient by its own RMS, so an element whose gradient is rounding noise moves by
    # up to lr (1e-3) either way: one such element of a down_proj differed by 1.2e-5, the rest by < 3e-6
    w_eager, w_compiled = eager.state_dict(), compiled.state_dict()
    for name, w in w_compiled.items():
        torch.testing.assert_close(w, w_eager[name], rtol=0, atol=5e-5, msg=name)
    # One graph serves every layer (so with 2 layers here as with 4): a graph per layer would hit dynamo's
    # cache limit at 8 layers and leave the others eager.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # New micro-batch lengths recompile with the dimensions that changed made dynamic (the sequence, then
    # the padded path's mask), after which every length reuses the graphs: no cache limit, no eager fallback
    for width in (11, 14):
        compiled.step(longer_batch(width))
    settled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert settled <= 3
    compiled.step(longer_batch(19))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == settled


def test_two_model_shapes_in_one_process_keep_their_structure_static(tiny_qwen3, tmp_path, monkeypatch):
    """Two learners of different shapes in one process (benchmark arms, the GPU suite in one run) compile one
    layer code, whose automatic dynamic shapes made every size that differed symbolic: FSDP2's
    `self_attn.head_dim` became an input `s19` (dynamo does not specialise an FSDP-managed module's ints), and
    inductor's FlexAttention lowering failed on the head count `64 // s19` (H200, torch 2.11). The second
    model's graphs keep its hidden size and head_dim static, a third length reuses both models' graphs, and
    both compiled learners take their eager twins' steps."""
    from tests.conftest import make_checkpoint

    graphs = []  # per graph: placeholder source -> its sizes (int where static) or its symbolic value
    aot_eager = torch._dynamo.backends.registry.lookup_backend("aot_eager")

    def size(d):
        if isinstance(d, int):
            return d
        expr = d.node.shape_env.replace(d.node.expr)  # after the guards that pinned it
        return int(expr) if expr.is_number else str(expr)

    def recording(gm, example_inputs):
        graph = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            value, source = node.meta["example_value"], node.meta["grapharg"].source.name
            if isinstance(value, torch.Tensor):
                graph[source] = tuple(size(d) for d in value.shape)
            elif isinstance(value, (torch.SymInt, torch.SymFloat)):
                graph[source] = str(value)
        graphs.append(graph)
        return aot_eager(gm, example_inputs)

    def structure(graph):
        """(hidden size, head_dim, symbolic module attributes) that a graph was compiled for."""
        return (graph["L['args'][0]"][-1], graph["L['kwargs']['position_embeddings'][0]"][-1],
                {k: v for k, v in graph.items() if k.startswith("L['self']") and not isinstance(v, tuple)})

    monkeypatch.setattr(compiled_layers, "BACKEND", recording)
    torch._dynamo.reset()
    make_checkpoint(tmp_path, hidden_size=128, head_dim=32)  # 4 query heads, 2 KV heads, as tiny_qwen3's
    shapes = {"a": (tmp_path, 128, 32), "b": (tiny_qwen3[0], 64, 16)}
    learners = {k: (make(path, True, grad_checkpointing=True),
                    make(path, True, grad_checkpointing=True, compile_layers=True)) for k, (path, _, _) in shapes.items()}

    def step(k, batch):
        start = len(graphs)
        eager, compiled = learners[k]
        m_eager, m_compiled = eager.step(batch), compiled.step(batch)
        assert m_compiled["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-4), k
        assert m_compiled["loss"] == pytest.approx(m_eager["loss"], rel=1e-4, abs=1e-6), k
        for graph in graphs[start:]:
            assert structure(graph) == (*shapes[k][1:], {}), k
        return graphs[start:]

    step("a", ragged_batch(1))
    step("b", ragged_batch(1))
    for width in (11, 14):
        new = step("b", longer_batch(width))
    assert new and all(isinstance(g["L['args'][0]"][1], str) for g in new)  # the sequence is symbolic
    step("a", longer_batch(14))
    assert step("a", longer_batch(19)) == [] and step("b", longer_batch(19)) == []  # every length reuses them


def longer_batch(width):
    """Four rows padded to `width` tokens (ragged_batch's are 8 wide)."""
    g = torch.Generator().manual_seed(width)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, width - 4, 2, 4)]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 4, 5, 3)]
    return build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], [[0] * len(r) for r in responses],
                       [1.0, -0.5, 0.3, -0.8], pad_id=0)


def test_a_model_without_decoder_layers_is_refused_by_name():
    with pytest.raises(ValueError, match="trainer.compile_layers: Sequential has no ...DecoderLayer"):
        compile_layers(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)])))


def test_decoder_layers_are_found_in_a_transformers_model(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3[0])
    assert decoder_layers(model) == list(model.model.layers)
    assert compiled_layers.BACKEND == "inductor"


def test_the_setting_is_a_trainer_option_whose_default_compiles_on_cuda_only():
    """null (the default) compiles on CUDA, where it was measured faster, and not on the CPU (the eager
    learner of the first test is built with the default and compiles nothing)."""
    assert TrainerConfig().compile_layers is None
    assert compiled_layers.compiles_by_default(torch.device("cuda"))
    assert not compiled_layers.compiles_by_default(torch.device("cpu"))
    RunConfig(device="cpu", trainer=TrainerConfig(compile_layers=True)).validate()
