"""`ppo_clip`'s options on CUDA tensors against the same call on the CPU (float64 both): rejection in bypass mode
(its shares are 0-d tensors read back with the loss's metrics: as Python floats they broke the one device-to-host
copy on CUDA), the dppo, ipo and vespo surrogates, the geometric sequence weights and their batch normalisation (the
learner's batch mean too). Fresh random inputs per run."""

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.trainer.behavior_is_norm import batch_mean_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SETTINGS = [
    {"behavior_rs": "token_k1,seq_max_k3", "behavior_rs_threshold": "1.5,0.5"},
    {"behavior_rs": "seq_mean_k2", "behavior_rs_threshold": 0.1, "ratio_level": "sequence"},
    {"surrogate": "dppo"},
    {"surrogate": "vespo", "behavior_rs": "token_k2", "behavior_rs_threshold": 0.2},
    {"old_logprob": "recompute", "behavior_is": "sequence_geo_mask", "behavior_is_min": 0.8, "behavior_is_max": 1.25},
    {"surrogate": "ipo", "ipo_threshold": 0.05},
    {"old_logprob": "recompute", "behavior_is": "token_truncate", "behavior_is_normalize": True},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_loss_and_its_metrics_on_cuda_equal_the_cpus(settings):
    lengths = torch.randint(1, 24, (12,))
    mask = torch.arange(24)[None] < lengths[:, None]
    behavior = -3 * torch.rand(12, 24, dtype=torch.float64)
    old = behavior + 0.3 * torch.randn(12, 24, dtype=torch.float64)
    logp = old + 0.4 * torch.randn(12, 24, dtype=torch.float64)
    adv = torch.randn(12, 1, dtype=torch.float64).expand(12, 24).clone()
    cfg = AlgoConfig(**settings)
    cfg.validate()
    results = {}
    for device in ("cpu", "cuda"):
        lp = logp.to(device).requires_grad_(True)
        inp = LossInputs(logprobs=lp, advantages=adv.to(device), mask=mask.to(device), old_logprobs=old.to(device),
                         behavior_logprobs=behavior.to(device), num_tokens=float(mask.sum()), num_seqs=12.0,
                         behavior_is_norm=torch.full_like(old, 0.9).to(device))
        loss, metrics = get_loss("ppo_clip")(inp, cfg)
        (grad,) = torch.autograd.grad(loss, lp)
        results[device] = (loss.item(), grad.cpu(), metrics)
    (cpu_loss, cpu_grad, cpu_metrics), (gpu_loss, gpu_grad, gpu_metrics) = results["cpu"], results["cuda"]
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(gpu_grad, cpu_grad, rtol=1e-9, atol=1e-12)
    assert gpu_metrics.keys() == cpu_metrics.keys()
    for key, value in cpu_metrics.items():
        assert gpu_metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_batch_mean_weight_on_cuda_equals_the_cpus(mode):
    lengths = torch.randint(0, 24, (12,))
    mask = (torch.arange(24)[None] < lengths[:, None]).float()
    behavior = -3 * torch.rand(12, 24)
    old = (behavior + 0.2 * torch.randn(12, 24)).double()
    s = AlgoConfig(old_logprob="recompute", behavior_is=mode, behavior_is_max=1.5,
                   behavior_is_normalize=True).section("ppo_clip")
    got = {}
    for device in ("cpu", "cuda"):
        batch = type("Batch", (), {"response_mask": mask.to(device), "behavior_logprobs": behavior.to(device)})()
        norm = batch_mean_weight(batch, old.to(device), s, None, 1)
        assert norm.device.type == device and norm.shape == old.shape
        got[device] = float(norm[0, 0])
    assert got["cuda"] == pytest.approx(got["cpu"], rel=1e-12) and got["cpu"] != 1.0
