"""The BF16 learner: policy log-probs, the registered policy loss, backward, clip, AdamW.

The policy is wrapped with FSDP2 (`fully_shard` per decoder layer, then the root) even on one
device, so more GPUs add ranks to the same code path. Master weights and AdamW state are fp32; on
CUDA FSDP2's mixed precision runs the forward/backward with bf16 parameters and reduces gradients
in fp32 (on CPU parameters stay fp32, so CPU tests are exact). `trainer.fsdp: false` keeps a plain
module under bf16 autocast. AdamW's state stays on the GPU unless `trainer.offload` (FSDP2's
CPUOffloadPolicy: weights, gradients and state in CPU memory) or `trainer.offload_optimizer` (only
the two moments in pinned CPU memory, streamed through the GPU: `kv4rl.trainer.offloaded_adamw`). A
process group of world size 1 is created when none exists (an in-process store: no port, so
concurrent runs cannot clash); one set up by the caller (torchrun) is used as it is.

Micro-batches are either `micro_batch_size` padded rows, or, with `max_tokens_per_micro_batch`,
rows packed without padding (`trainer.packing`); either way the loss sees padded `[b, L-1]` tensors
and the mini-batch's token and sequence counts, so the update is the same. Packed rows run FlexAttention
on CUDA by default (`trainer.attention`), whose block mask skips the attention across sequences.

The engine receives full, plain weights through `state_dict()` after every update. The loss says
which optional inputs it reads (`LossSpec.inputs`); the learner computes only those. The frozen
reference policy (bf16 on CUDA, fp32 on CPU) is loaded only if its log-probs are ever used: every
step when `algo.kl_ref_coef > 0`, else every `ref_kl_every` iterations for the logged `kl_ref`
(0: never). The policy's own pre-update log-probs are computed only for `old_logprobs`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.logprobs import sum_pi_squared, token_logprobs, token_logprobs_and_entropy
from kv4rl.algo.losses import combine_metrics
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.algo.rejection import rejection_rules
from kv4rl.trainer.attention import document_block_mask, resolve_attention, set_attention
from kv4rl.trainer.batch import TrainBatch
from kv4rl.trainer.compiled_layers import compile_layers as compile_decoder_layers
from kv4rl.trainer.entropy_control import EntropyControl
from kv4rl.trainer.entropy_tokens import high_entropy_tokens
from kv4rl.trainer.rank_sums import every_rank, global_counts, rank_passes
from kv4rl.trainer.behavior_is_norm import batch_mean_weight
from kv4rl.trainer.rejected_tokens import without_rejected
from kv4rl.trainer.compiled_layers import compiles_by_default, decoder_layers
from kv4rl.trainer.fused_elementwise import can_fuse, fuses_by_default
from kv4rl.trainer.fused_elementwise import fuse_elementwise as fuse_elementwise_modules
from kv4rl.trainer.host_memory import check_host_memory, count_parameters
from kv4rl.trainer.learner_options import check_learner_options, describe_options, fused_logprobs_by_default
from kv4rl.trainer.offloaded_adamw import OffloadedAdamW
from kv4rl.trainer.update_memory import largest_micro_batch, measure_update_memory
from kv4rl.trainer.update_stats import global_scalar, token_stats, warn_left_out
from kv4rl.trainer.learner_checkpointing import LearnerCheckpointing
from kv4rl.trainer.packing import pack_rows, plan_micro_batches
from kv4rl.trainer.policy_model import load_hf_model, load_reference, prepare_policy, shard_policy

FROM_BATCH = frozenset({"behavior_logprobs", "versions"})  # loss inputs a TrainBatch already holds
log = logging.getLogger(__name__)


class Learner(LearnerCheckpointing):
    def __init__(self, policy_path: str | Path | nn.Module, ref_path: str | Path | nn.Module | None, *,
                 algo: AlgoConfig, lr: float, weight_decay: float, betas: tuple[float, float], grad_clip: float,
                 micro_batch_size: int, updates_per_batch: int, temperature: float,
                 device: torch.device, grad_checkpointing: bool = False, fsdp: bool = True,
                 offload: bool = False, max_tokens_per_micro_batch: int | None = None, ref_kl_every: int = 1,
                 attention: str = "auto", group: dist.ProcessGroup | None = None,
                 fuse_elementwise: bool | None = None, compile_layers: bool | None = None,
                 fused_logprobs: bool | None = None, offload_optimizer: bool = False, epochs_per_batch: int = 1,
                 max_new_tokens: int | None = None):
        """`policy_path`/`ref_path` are HF folders, or in-memory transformers models (benchmarks): the
        policy in fp32 on `device`, the reference in the dtype it should run in. `attention`: see
        `trainer.attention` (kv4rl.trainer.attention). `group`: the learner's ranks when they are not
        the whole job (split placement: `kv4rl.split`). `fuse_elementwise`: RMSNorms and SwiGLU through
        compiled functions (`kv4rl.trainer.fused_elementwise`), policy and reference; None: `fuses_by_default`
        and only when the model has a norm it knows. `compile_layers`: every decoder layer as one compiled
        region (`kv4rl.trainer.compiled_layers`), policy and reference; None: on CUDA when the model has
        decoder layers it recognises. `fused_logprobs`: the log-prob head (log-probs, entropy, their
        gradient) in Triton (`kv4rl.kernels.logprob_head`); None: where those kernels can run on CUDA.
        `offload_optimizer`: AdamW's moments in pinned CPU memory (`kv4rl.trainer.offloaded_adamw`). `epochs_per_batch`:
        passes over the batch (verl's ppo_epochs). `max_new_tokens`: `token_sum_norm`'s length."""
        check_learner_options(device, fsdp=fsdp, offload=offload, attention=attention, fused_logprobs=fused_logprobs,
                              offload_optimizer=offload_optimizer)
        if fused_logprobs is None:
            fused_logprobs = fused_logprobs_by_default(device)
        self.fused_logprobs = fused_logprobs
        self.group = group
        ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        if offload or offload_optimizer:  # before any weights are read: an OOM kill gives no error of its own
            num_params = sum(p.numel() for p in policy_path.parameters()) if isinstance(policy_path, nn.Module) \
                else count_parameters(policy_path)
            check_host_memory(num_params, offload=offload, offload_optimizer=offload_optimizer, world_size=ranks)
        if not fsdp and ranks > 1:
            raise ValueError(f"{ranks} ranks need trainer.fsdp=true: the data-parallel learner "
                             "is FSDP2's (one shard per rank, gradients reduced across ranks)")
        for name, value, least in (("max_tokens_per_micro_batch", max_tokens_per_micro_batch, 1),
                                   ("ref_kl_every", ref_kl_every, 0), ("epochs_per_batch", epochs_per_batch, 1)):
            if value is not None and value < least:
                raise ValueError(f"trainer.{name} must be >= {least}, got {value}")
        self.device = device
        self.algo = algo
        self.norm_tokens = algo.norm_tokens(max_new_tokens)
        self.loss_fn = get_loss(algo.loss)
        self.loss_inputs = self.loss_fn.inputs(algo)  # the optional LossInputs fields to fill
        ppo = algo.section("ppo_clip") if algo.loss == "ppo_clip" else None  # verl's rollout_rs, π_old recomputed
        decoupled = ppo is not None and ppo.old_logprob == "recompute"  # (bypass mode's is the loss's own)
        self.rejection = rejection_rules(ppo.behavior_rs, ppo.behavior_rs_threshold) if decoupled else ()
        self.temperature, self.grad_clip = temperature, grad_clip
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_micro_batch
        self.updates_per_batch, self.epochs_per_batch = updates_per_batch, epochs_per_batch
        self.ref_kl_every = ref_kl_every
        self.entropy = EntropyControl.from_algo(algo)  # the bonus's coefficient, fixed or adaptive
        self.fsdp, self.offload, self.offload_optimizer = fsdp, offload, offload_optimizer
        self.num_steps = 0  # steps taken; the reference schedule's clock when no iteration is given
        if isinstance(policy_path, nn.Module):
            self.model = prepare_policy(policy_path, grad_checkpointing)
        else:
            self.model = load_hf_model(policy_path, device, grad_checkpointing)
        if fuse_elementwise is None:
            fuse_elementwise = fuses_by_default(device) and can_fuse(self.model)
        self.fused_elementwise = fuse_elementwise_modules(self.model) if fuse_elementwise else None
        if compile_layers is None:
            compile_layers = compiles_by_default(device) and bool(decoder_layers(self.model))
        self.compiled_layers = compile_decoder_layers(self.model) if compile_layers else 0
        if fsdp:
            shard_policy(self.model, device, offload, group)
        # Each rank's loss is divided by the global token (or sequence) count, and FSDP2 averages the
        # ranks' gradients: the backward pass scales by the world size so the average is the sum.
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0  # within the learner ranks
        self.ref_model = None
        if ref_path is not None and "ref_logprobs" in self.loss_inputs and (algo.kl_ref_coef > 0 or ref_kl_every):
            self.ref_model = load_reference(ref_path, device)
            if fuse_elementwise:
                fuse_elementwise_modules(self.ref_model)
            if compile_layers:
                compile_decoder_layers(self.ref_model)
        self.attention = ""  # the kernel in use, `sdpa` or `flex` (set_attention)
        self.set_attention(attention)
        if offload_optimizer:
            self.optimizer = OffloadedAdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                               betas=betas, fused=device.type == "cuda")
        # what a restored optimizer state must not bring back (`load_checkpoint_state`)
        self._configured = {key: self.optimizer.param_groups[0][key] for key in ("weight_decay", "betas", "eps")}

    @property
    def options_desc(self) -> str:
        """The speed options in effect and where AdamW's state lives, for the run's start line."""
        return describe_options(self.device, fused_elementwise=bool(self.fused_elementwise),
                                compiled_layers=self.compiled_layers, fused_logprobs=self.fused_logprobs,
                                offload=self.offload, offload_optimizer=self.offload_optimizer)

    def set_attention(self, choice: str) -> str:
        """Run the policy and the reference with `choice` (auto, sdpa, flex) for the current micro-batch
        layout (`max_tokens`); returns the kernel chosen."""
        self.attention = resolve_attention(choice, self.device, packed=self.max_tokens is not None)
        for model in (self.model, self.ref_model):
            if model is not None:
                set_attention(model, self.attention)
        return self.attention

    def _autocast(self):
        if self.device.type == "cuda" and not self.fsdp:  # FSDP2 casts the parameters itself
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits(self, model, mb: TrainBatch):
        """(logits of micro-batch `mb`'s next tokens, those tokens, and how a per-token value of theirs comes back to
        `[b, L-1]`), padded or packed."""
        if self.max_tokens is None:
            with self._autocast():
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
            return logits, mb.input_ids[:, 1:], lambda values: values
        packed = pack_rows(mb.input_ids, mb.attention_mask)
        # SDPA: attention_mask=None and transformers masks the packed sequences apart from the restarting
        # positions; flex: the block mask of the sequences, built here (see trainer/attention.py)
        mask = document_block_mask(mb.attention_mask.sum(1)) if self.attention == "flex" else None
        with self._autocast():
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                           attention_mask=mask).logits[:, :-1]
        return logits, packed.input_ids[:, 1:], packed.unpack

    def _forward(self, model, mb: TrainBatch, with_entropy: bool = False):
        """Per-token log-probs (and entropy) `[b, L-1]` of micro-batch `mb`, padded or packed."""
        logits, ids, unpack = self._logits(model, mb)
        logp, ent = self._logprob_head(logits, ids, with_entropy)
        return unpack(logp), (unpack(ent) if ent is not None else None)

    def _logprob_head(self, logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool):
        """Log-probs and, if asked, entropies of `logits / temperature` at `ids` (both differentiable)."""
        if self.fused_logprobs:
            from kv4rl.kernels.logprob_head import fused_token_logprobs  # Triton: imported only when used

            logp, ent = fused_token_logprobs(logits, ids, self.temperature)  # the entropy comes with the pass
            return logp, (ent if with_entropy else None)
        if with_entropy:  # one pass for both; the entropy's gradient is taken only if it reaches the loss
            return token_logprobs_and_entropy(logits, ids, self.temperature)
        return token_logprobs(logits, ids, self.temperature), None

    def update_memory_bytes(self, max_len: int) -> int:
        """Device bytes its update will allocate beyond what it holds now, for sequences of at most `max_len`
        tokens (measured: `kv4rl.trainer.update_memory`); 0 off CUDA; a collective under FSDP."""
        if self.device.type != "cuda":
            return 0
        mb = largest_micro_batch(max_len, self.max_tokens, self.micro_batch_size).to(self.device)
        return measure_update_memory(lambda: self._forward(self.model, mb, with_entropy=True)[0], self.optimizer,
                                     self.device)

    def micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """The micro-batches (row indices of `batch`) that `rows` is processed in.

        Padded: consecutive runs of `micro_batch_size` rows. Packed: rows grouped by
        `plan_micro_batches` into at most `max_tokens_per_micro_batch` real tokens each; a single row
        longer than that budget still goes alone.
        """
        if self.max_tokens is None:
            return list(rows.split(self.micro_batch_size))
        lengths = batch.attention_mask[rows].sum(1).tolist()
        return [rows[torch.tensor(group, device=rows.device)] for group in plan_micro_batches(lengths, self.max_tokens)]

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch, sum_pi_sq: bool = False):
        """Per-token log-probs `[B, L-1]` of `batch` under `model`; with `sum_pi_sq`, and Σ_v π(v)² of the same pass."""
        out = torch.zeros_like(batch.response_mask)
        spsq = torch.zeros_like(batch.response_mask) if sum_pi_sq else None
        rows = torch.arange(len(batch), device=batch.input_ids.device)
        micro = self.micro_batches(batch, rows)
        # the sharded policy needs every rank in every pass; the reference model is not sharded
        sharded = model is self.model
        passes = rank_passes(self.group, self.world_size, micro, rows) if sharded else ((m, False) for m in micro)
        for mb_rows, dummy in passes:
            logits, ids, unpack = self._logits(model, batch.select(mb_rows))
            logp = unpack(self._logprob_head(logits, ids, False)[0])
            if not dummy:
                out[mb_rows] = logp.float()
                if spsq is not None:
                    spsq[mb_rows] = unpack(sum_pi_squared(logits, self.temperature))
        return out if spsq is None else (out, spsq)

    def logprobs_and_sum_pi_squared(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and Σ_v π(v)² [B, L-1] of `batch` under the current weights (one forward, packed as
        the update's; verl's calculate_sum_pi_squared, for the optimal-token baseline), at the sampling temperature."""
        return self._logprobs(self.model, batch.to(self.device), sum_pi_sq=True)

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, L-1] of `batch` under the current weights, as the first update sees them, or the
        frozen reference's (no grad; mismatch attribution, a KL penalty in the reward)."""
        if reference and self.ref_model is None:
            raise ValueError("the reference model is not loaded (trainer.ref_kl_every=0 with algo.kl_ref_coef=0, or "
                             "a loss that reads no reference log-probs)")
        return self._logprobs(self.ref_model if reference else self.model, batch.to(self.device))

    def ref_due(self, iteration: int) -> bool:
        """Whether this iteration computes reference log-probs (loss term or logged `kl_ref`)."""
        if self.ref_model is None:
            return False
        return self.algo.kl_ref_coef > 0 or (self.ref_kl_every > 0 and iteration % self.ref_kl_every == 0)

    def _before_update_inputs(self, batch: TrainBatch, iteration: int, given: dict) -> dict[str, torch.Tensor]:
        """The loss inputs that cost a forward pass over the whole batch before its first update (`given`: taken
        already, by `logprobs` before the advantages)."""
        out = {name: given[name].to(self.device) for name in self.loss_inputs & given.keys()}
        if "ref_logprobs" in self.loss_inputs and "ref_logprobs" not in out and self.ref_due(iteration):
            out["ref_logprobs"] = self._logprobs(self.ref_model, batch)
        if "old_logprobs" in self.loss_inputs and "old_logprobs" not in out:
            out["old_logprobs"] = self._logprobs(self.model, batch)
        return out

    def step(self, batch: TrainBatch, lr: float | None = None, iteration: int | None = None,
             given: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One learner batch: `updates_per_batch` optimizer steps over contiguous mini-batches, `epochs_per_batch`
        times over (the old log-probs and the reference's are taken once, before the first step, or `given`).

        `iteration` clocks the `ref_kl_every` schedule (default: the number of steps taken so far). A step whose
        gradient norm is not finite is left out (`skipped_steps`, with a warning), as verl's actor does: one NaN
        would otherwise turn every weight into NaN and the run would go on sampling from a broken policy.
        """
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        batch = batch.to(self.device)
        before_update = self._before_update_inputs(batch, self.num_steps if iteration is None else iteration,
                                                   given or {})
        parts: list[tuple[dict[str, float], float]] = []  # per micro-batch, merged by combine_metrics
        if "behavior_is_norm" in self.loss_inputs:  # over every sampled token, before any is rejected (as verl)
            before_update["behavior_is_norm"] = batch_mean_weight(batch, before_update["old_logprobs"],
                                                                  self.algo.section("ppo_clip"), self.group,
                                                                  self.world_size)
        if self.rejection:  # verl's rollout_rs: the tokens sampled too far from π_old leave the mask
            if "sampled_mask" in self.loss_inputs:
                before_update["sampled_mask"] = batch.response_mask
            batch, parts = without_rejected(batch, before_update["old_logprobs"], self.rejection)
        skipped = empty = 0  # optimizer steps left out: a non-finite gradient norm / no token to train
        controlled: dict[str, float] = {}  # the adaptive entropy coefficient after the last step, and its entropy
        nonfinite_losses = 0  # micro-batches whose loss was NaN or inf (a gradient can still be finite)
        stepped = False  # the mismatch is measured before the batch's first step
        if len(batch) < self.updates_per_batch:
            where = "this rank's share of the learner batch" if self.world_size > 1 else "the learner batch"
            raise ValueError(f"trainer.updates_per_batch={self.updates_per_batch} optimizer steps need at least as many "
                             f"rows in {where}, which has {len(batch)} here")
        # exactly updates_per_batch mini-batches within one row of each other (`chunk` made 4 of 8 rows in 6)
        rows = torch.arange(len(batch), device=self.device).tensor_split(self.updates_per_batch)
        for mini_rows in rows * self.epochs_per_batch:
            mini = batch.select(mini_rows)
            num_seqs = float((mini.response_mask.sum(1) > 0).sum())
            num_tokens, num_seqs = global_counts(self.group, self.world_size, mini.num_tokens, num_seqs)
            if num_tokens == 0:  # all masked on every rank: no step (AdamW would still decay on a zero gradient)
                empty += 1
                continue
            self.optimizer.zero_grad(set_to_none=True)
            micro = self.micro_batches(batch, mini_rows)
            for mb_rows, dummy in rank_passes(self.group, self.world_size, micro, mini_rows):  # a dummy pass has zero weight
                mb = batch.select(mb_rows)
                logp, ent = self._forward(self.model, mb, with_entropy=True)
                optional = {name: getattr(mb, name) for name in FROM_BATCH & self.loss_inputs}
                optional.update({name: values[mb_rows] for name, values in before_update.items()})
                keep = None if self.algo.top_entropy_quantile == 1 else high_entropy_tokens(
                    self.group, self.world_size, ent, mb.response_mask, self.algo.top_entropy_quantile, dummy)
                inp = LossInputs(logprobs=logp, advantages=mb.advantages, mask=mb.response_mask, num_tokens=num_tokens,
                                 num_seqs=num_seqs, norm_tokens=self.norm_tokens, keep=keep, **optional)
                loss, metrics = self.loss_fn(inp, self.algo)
                if self.entropy.on:  # verl's entropy bonus, aggregated as the loss is (its coefficient adaptive)
                    loss = loss - self.entropy.applied() * inp.aggregate(ent, inp.mask.bool(), self.algo.loss_agg)
                    if self.entropy.adaptive and not dummy:  # over the trained tokens (top_entropy_quantile's)
                        trained = inp.mask.bool() if keep is None else inp.mask.bool() & keep.bool()
                        self.entropy.observe(float((ent.detach() * trained).sum()), float(trained.sum()))
                if dummy:
                    (loss * 0.0).backward()
                    continue
                (loss * self.world_size if self.world_size > 1 else loss).backward()
                metrics = dict(metrics, loss=float(loss.detach()) * num_tokens / max(mb.num_tokens, 1.0))
                nonfinite_losses += not math.isfinite(metrics["loss"])
                metrics.update(token_stats(logp.detach(), ent.detach(), mb, first=not stepped and not self.rejection))
                parts.append((metrics, mb.num_tokens))
            if self.entropy.adaptive:  # the next step's coefficient, from this step's entropy over every rank
                controlled = self.entropy.step_end(self.group, self.world_size)  # the batch's last step is logged
            grad_norm = global_scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
            if math.isfinite(grad_norm):  # the global norm, the same on every rank
                parts.append(({"grad_norm": grad_norm}, 1.0))  # the steps taken (`skipped_steps` counts the rest)
                self.optimizer.step()
                stepped = True
            else:  # a NaN or inf gradient would make every weight NaN: every rank skips this step alike
                skipped += 1
                # not left on the parameters: a save before any step would keep an empty AdamW state (torch fills
                # it for saving only without gradients), which resumes differently, and under FSDP not at all
                self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        if self.rank == 0:
            warn_left_out(self.num_steps - 1 if iteration is None else iteration, len(rows) * self.epochs_per_batch,
                          nonfinite_losses, empty, skipped, self.algo.loss)
        out = {"grad_norm": math.nan, **combine_metrics(every_rank(self.group, self.world_size, parts))}
        out.update(skipped_steps=skipped, empty_steps=empty, **controlled)
        out["num_tokens"] = global_counts(self.group, self.world_size, batch.num_tokens, 0.0)[0]
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, plain (non-sharded) fp32 weights under Hugging Face names, for the engine refresh."""
        if not self.fsdp:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights one parameter at a time (each FSDP2 shard gathered when reached): a weight refresh that
        never holds a second whole copy (the engine copies each tensor, drops it before the next is gathered). Every
        rank must consume the stream (the gathers are collectives). A tied head appears once, as the embedding."""
        for name, param in self.model.named_parameters():
            full = getattr(param, "full_tensor", None)
            yield name, (full() if full is not None else param).detach()

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Each parameter's gradient as a full plain tensor (None-free: parameters without one are left out)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                full = getattr(p.grad, "full_tensor", None)
                out[name] = full() if full is not None else p.grad
        return out
