"""Try testbed build settings (steps, batch, lr, digits, shape) without touching the cache's recipes."""
import argparse
import dataclasses
import json
import sys
import tempfile

from kv4rl.models import testbed

p = argparse.ArgumentParser()
p.add_argument("--name", default="longmul-gpu")
p.add_argument("--steps", type=int)
p.add_argument("--batch", type=int)
p.add_argument("--lr", type=float)
p.add_argument("--task", type=json.loads)
p.add_argument("--shape", type=json.loads)
p.add_argument("--eval", type=int)
p.add_argument("--target", type=float)
a = p.parse_args()
spec = testbed.SPECS[a.name]
changes = {k: v for k, v in {"steps": a.steps, "batch_size": a.batch, "learning_rate": a.lr,
                             "task_settings": a.task, "eval_problems": a.eval,
                             "target_accuracy": a.target}.items() if v is not None}
if a.shape:
    changes["model_shape"] = {**spec.model_shape, **a.shape}
spec = dataclasses.replace(spec, **changes)
testbed.SPECS[a.name] = spec
with tempfile.TemporaryDirectory() as cache:
    path = testbed.testbed_model_dir(a.name, cache)
    json.dump(testbed.read_metadata(path), sys.stdout, indent=1)
