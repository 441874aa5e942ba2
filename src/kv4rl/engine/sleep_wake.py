"""The engine's sleep and wake: the KV pool and decode graphs freed for a learner's update on the same
device, and allocated again (re-sized from free memory where the start-up sized them so). `Engine` takes
them as a mixin; unfinished requests survive by recomputation (`Scheduler.preempt_all`)."""

from __future__ import annotations

import torch

from kv4rl.engine.block_manager import BlockManager


class EngineSleep:
    def sleep(self) -> None:
        """Free the KV pool and the decode CUDA graphs, so a learner on the same device can use that
        memory during its update. The weights stay (`load_weights` works while asleep).

        Unfinished requests survive by recomputation, not by a host copy of their KV: every running
        sequence is preempted (the scheduler's own path: blocks freed, sampled tokens, log-probs and
        versions kept, re-queued in order) and re-prefilled after `wake`, under the weights loaded by
        then, exactly as `rollout.carry: recompute` does. Queued requests may still be added or aborted.
        """
        if self.asleep:
            raise RuntimeError("the engine is already asleep")
        self.drain()
        self.scheduler.preempt_all()
        self.scheduler.forget_prefixes()  # parents lose their KV
        self.runner.sleep()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed pages back to the device, not only to torch's cache
        self.asleep = True

    def wake(self) -> None:
        """Allocate the pool and graphs again (after the weight refresh). A pool that the start-up sized
        from device memory (CUDA, `num_kv_blocks: null`) is re-sized from what is free now, with the
        same `gpu_memory_fraction` and the activation peak measured at start-up; it never holds less
        than one `max_model_len` sequence, which covers every queued request (else a ValueError naming
        `engine.gpu_memory_fraction`). Other pools keep their size. The graph buckets used before
        `sleep` are captured again here, so the capture time counts as wake time, not rollout time."""
        if not self.asleep:
            raise RuntimeError("the engine is awake; wake() follows sleep()")
        self.runner.wake()
        if self.runner.num_blocks != self.scheduler.blocks.num_blocks:  # every block is free after sleep
            self.scheduler.blocks = BlockManager(self.runner.num_blocks, self.config.kv.block_size)
        self.pool_tokens = self.runner.num_blocks * self.config.kv.block_size
        self.pool_bytes = self.runner.cache_bytes
        self.asleep = False
