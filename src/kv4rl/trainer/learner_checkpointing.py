"""What a learner saves and restores: the policy as a Hugging Face folder, and AdamW's state, full in the trainer
state at world size 1 or one DCP shard per rank beyond (`kv4rl.trainer.optimizer_checkpoint`), with an adaptive
entropy coefficient's state. A mixin of `Learner`,
which holds the model, optimizer, group and world size these read."""

from __future__ import annotations

from pathlib import Path

import torch

from kv4rl.trainer.entropy_control import EntropyControl
from kv4rl.trainer.optimizer_checkpoint import (FULL, SHARDED, full_state, load_full_state, load_shards,
                                                 optimizer_format, save_shards)
from kv4rl.trainer.policy_folder import write_policy_folder


class LearnerCheckpointing:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    world_size: int
    group: object  # the learner's process group (None: the whole job)
    _configured: dict  # the optimizer settings a restored state must not bring back
    entropy: EntropyControl  # the entropy bonus's coefficient (adaptive: saved with the checkpoint)

    def save_pretrained(self, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """The policy as a Hugging Face folder (safetensors). `state`: the full weights already gathered (under
        FSDP2 every rank takes part in gathering; one rank writes)."""
        if state is None:
            state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        write_policy_folder(self.model, path, state)

    @property
    def optimizer_format(self) -> str:
        """Optimizer state in checkpoints: full in the trainer state at world size 1, a DCP shard per rank beyond."""
        return SHARDED if self.world_size > 1 else FULL

    def checkpoint_state(self) -> dict:
        """What a resume needs beyond the weights, with the optimizer format and the world size. One rank:
        the AdamW moments and step counts, full plain tensors on CPU keyed by parameter name. Several
        ranks: the shards are written by `write_shards`, never gathered."""
        entropy = {"entropy_control": self.entropy.state_dict()} if self.entropy.adaptive else {}
        if self.optimizer_format == SHARDED:
            return {"optimizer_format": SHARDED, "world": self.world_size, **entropy}
        return {"optimizer_format": FULL, "world": 1, "optimizer": full_state(self.model, self.optimizer), **entropy}

    def write_shards(self, folder: Path) -> None:
        """Every rank writes its optimizer shard into `folder` (a collective); nothing at world size 1."""
        if self.optimizer_format == SHARDED:
            save_shards(self.model, self.optimizer, folder, self.group)

    def load_checkpoint_state(self, state: dict, folder: Path | None = None) -> None:
        """Restore `checkpoint_state()` (or an older one); a sharded one reads its shards from `folder`."""
        if optimizer_format(state) != SHARDED:
            load_full_state(self.model, self.optimizer, state["optimizer"])
        elif folder is None:
            raise ValueError("a checkpoint with sharded optimizer state loads from its folder: pass `folder`")
        else:
            load_shards(self.model, self.optimizer, folder, self.group)
        if self.entropy.adaptive and "entropy_control" in state:  # the adaptive coefficient goes on where it was
            self.entropy.load_state_dict(state["entropy_control"])
        # load_state_dict restored the saved groups' settings: a resume changing weight_decay or betas ran the old
        for group in self.optimizer.param_groups:
            group.update(self._configured)
