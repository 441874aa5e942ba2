"""Continuous batching: admit waiting requests as slots and KV blocks free up; preempt on OOM.

Every step advances every running sequence by one token (decodes) or by its next prompt chunk, and in
the same batch prefills newly admitted (or re-admitted) sequences within the token budget
`max_num_batched_tokens`. Decodes come first, so admissions never starve them. With chunked prefill a
prompt that does not fit the rest of the budget is admitted with a chunk of it; its later chunks come
in the next steps (at least one token each, so a running sequence always advances) and attend to the
earlier ones through the cache, and only the step that reaches its last token samples. Without
chunking such a prompt waits, and one longer than the whole budget runs alone. Because a sequence's
progress never waits on other sequences' prefills, a resumed or recomputed sequence keeps the same
step-by-step timeline as an uninterrupted one. When a running sequence needs a block and the pool is empty, the
most recently admitted sequence is preempted: its blocks are freed, its sampled tokens kept, and it
is re-queued at the front to be recomputed (its whole prefix is prefilled again). Nothing is ever
dropped. Each running sequence also holds one of `max_num_seqs` running slots, which indexes
per-sequence cache state (KV4's protected rows); it is taken on admission and given back on finish
or preemption. Torch-free, so the invariants are tested on CPU with random lengths.

Prefix sharing (GRPO groups: G requests with one prompt). A fresh request (no sampled tokens yet)
whose prompt was computed in the previous step by a still-running sequence that has not decoded
since (its "parent") is forked instead of prefilled: it shares the parent's whole blocks below its
last prompt position P-1 (reference-counted), gets a private block for P-1 into which the runner
copies the shared positions of that block (copy-on-write), inherits the parent's per-sequence rows,
and computes only position P-1, whose logits give its first token. A request whose prompt is being
prefilled in the current batch waits one step for that KV instead of prefilling a second copy; the
requests behind it are still admitted; so does one whose prompt a running sequence is still prefilling in
chunks, until the step that completes it. Recomputed and resumed requests prefill as before. Because
every sequence samples from counter-based noise, forked and prefilled requests draw the same tokens.

With `admit_siblings_together` a fresh request whose prompt heads a run of waiting siblings (requests
with the same prompt, as a GRPO group is queued) is admitted only when the free running slots hold the
whole run, counting the slots its deferred siblings will take next step; it waits, and the queue
behind it too, while other sequences run and can free slots. A run counts at most an eighth of
`max_num_seqs` (at least one), so a group much larger than that enters in parts of that size, each
prefilling once, and waiting never idles more than an eighth of the slots. Otherwise, when
slots free one at a time (partial rollout tops up the engine as responses finish), each sibling is
admitted a step after the one before it decoded past the prompt, and every one prefills the whole
prompt: at the Qwen3-1.7B shape 100 of 128 prompts were prefilled so, in steps that also run every
decode row outside the CUDA graphs (bench/RESULTS.md). Waiting idles a few slots (about half a group
on average) and turns those ~100 prefills into one prefill and one forking step per group.
"""

from __future__ import annotations

from array import array
from collections import deque

from kv4rl.engine.block_manager import BlockManager, blocks_needed
from kv4rl.engine.sequence import PrefixFork, Sequence, Status


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        prefix_sharing: bool = False,
        chunked_prefill: bool = False,
        admit_siblings_together: bool = False,
    ):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._free_seq_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest
        self.prefix_sharing = prefix_sharing
        self.chunked_prefill = chunked_prefill
        self.admit_siblings_together = admit_siblings_together and prefix_sharing
        self.num_sibling_waits = 0  # steps in which a group waited for slots to admit it whole
        self._prefix_parents: dict[bytes, Sequence] = {}  # prompt -> who computed it last step
        self._chunking: dict[bytes, Sequence] = {}  # prompt -> who is prefilling it in chunks
        self.num_forks = 0
        self.prefill_tokens_saved = 0  # prompt tokens forked requests did not compute

    def add(self, seq: Sequence) -> None:
        """Queue a request; refuse at once one that could never fit, instead of hanging later."""
        self.check_fits(len(seq.prompt_ids), seq.params.max_tokens)
        self.waiting.append(seq)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse (ValueError) a request of this prompt and response limit that could never run."""
        longest = min(prompt_len + max_tokens, self.max_model_len)
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt of {prompt_len} tokens does not fit max_model_len={self.max_model_len}")
        need = blocks_needed(longest, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"KV pool too small for one request: it needs {need} blocks of "
                f"{self.blocks.block_size} tokens ({longest} tokens) but the pool has "
                f"{self.blocks.num_blocks}; raise engine.num_kv_blocks or lower the token limits"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, skip: frozenset[int] | set[int] = frozenset()) -> list[Sequence]:
        """The next batch: one decode token for each running sequence, the next chunk of each running
        prefill, then new admissions. Each sequence's `chunk` says how many new tokens it computes.
        `skip`: ids of running sequences left out of this batch (they stop with a token the host has not
        read: `kv4rl.engine.run_ahead`); they stay running until that token is read."""
        parents, self._prefix_parents = self._prefix_parents, {}
        running = self._decode_batch(skip)
        prefilling = []  # (seq, its new tokens): prompts still prefilling in chunks
        decodes = 0
        for seq in running:  # one pass: this is per-step host work at every batch size
            seq.chunk = 0
            _, new, _ = seq.step_counts()
            if new > 1:
                prefilling.append((seq, new))
            elif new == 1:
                decodes += 1
                if seq.num_cached_tokens < len(seq.prompt_ids):  # a chunked prompt's last token: its KV
                    self._set_chunk(seq, 1, 1)  # is whole after this step, a parent for the next
        budget = self.max_num_batched_tokens - decodes
        for seq, new in prefilling:
            take = max(1, min(new, budget))
            budget -= take
            self._set_chunk(seq, take, new)
        return running + self._admit(budget, parents)

    def _set_chunk(self, seq: Sequence, take: int, new_tokens: int) -> None:
        """Schedule `take` of `seq`'s `new_tokens`; a shareable prompt completed by this step becomes a
        parent for the next one, one left unfinished keeps requests with the same prompt waiting."""
        seq.chunk = take if take < new_tokens else 0
        key = self._share_key(seq)
        if key is None:
            return
        if take < new_tokens:
            self._chunking[key] = seq
            return
        if self._chunking.get(key) is seq:
            del self._chunking[key]
        if seq.params.max_tokens > 1 and len(seq) + 1 < self.max_model_len:
            self._prefix_parents.setdefault(key, seq)  # a parent next step, unless it stops at EOS

    def _prefilling(self, key: bytes) -> bool:
        """A running sequence is computing this prompt in chunks (entries of preempted ones are stale)."""
        seq = self._chunking.get(key)
        if seq is not None and seq.status is Status.RUNNING and seq.num_cached_tokens < len(seq.prompt_ids):
            return True
        self._chunking.pop(key, None)
        return False

    def _admit(self, budget: int, parents: dict[bytes, Sequence]) -> list[Sequence]:
        batch: list[Sequence] = []
        deferred: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            key = self._share_key(seq)
            parent = parents.get(key) if key is not None else None
            if parent is not None and not self._holds_prompt(parent):
                parent = None
            if parent is None and key is not None and (key in self._prefix_parents or self._prefilling(key)):
                deferred.append(self.waiting.popleft())  # its prompt's KV exists after this (or a later) step
                continue
            if parent is None and key is not None and self.admit_siblings_together and self.running:
                free = self.max_num_seqs - len(self.running) - len(deferred)
                if free < self._sibling_run(seq):
                    self.num_sibling_waits += 1
                    break  # running sequences will free slots: admit the group whole then
            # one token of headroom: the prefill samples a token whose KV the next step writes
            if parent is not None:
                shared = (len(seq.prompt_ids) - 1) // self.blocks.block_size
                if blocks_needed(len(seq) + 1, self.blocks.block_size) - shared > self.blocks.num_free_blocks:
                    break
                new_tokens = 1
            else:
                if not self.blocks.can_grow(seq, len(seq) + 1):
                    break
                new_tokens = seq.num_new_tokens
            if self.chunked_prefill:
                if budget < 1:
                    break
                take = min(new_tokens, budget)
            elif new_tokens > budget and (batch or len(self.running) > 0):
                break  # a prompt longer than the whole budget still runs, alone
            else:
                take = new_tokens
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.seq_slot = self._free_seq_slots.pop()
            if parent is not None:
                self._fork(seq, parent, shared)
            else:
                self.blocks.grow(seq, len(seq))
            budget -= take
            self.running.append(seq)
            batch.append(seq)
            self._set_chunk(seq, take, seq.num_new_tokens)
        self.waiting.extendleft(reversed(deferred))
        return batch

    def admits_nothing_next(self) -> bool:
        """The next `schedule` admits no waiting request for certain (False when it may): the queue is
        empty, every slot is taken, or its head is a fresh group waiting for the slots of its whole run
        (`admit_siblings_together`) with no parent to fork from and no copy of its prompt prefilling.
        Asynchronous scheduling runs ahead only then; in partial rollout a group waits so for most steps."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return True
        seq = self.waiting[0]
        key = self._share_key(seq)
        if key is None or not self.admit_siblings_together or not self.running:
            return False
        if key in self._prefix_parents or self._prefilling(key):
            return False  # forked or deferred: the queue behind it may be admitted
        return self.max_num_seqs - len(self.running) < self._sibling_run(seq)

    def _share_key(self, seq: Sequence) -> bytes | None:
        """The prompt, for a request that may share it; None when it must prefill on its own. Bytes, made once
        a request: they keep their hash and compare by memcmp, where a tuple of the prompt was built and
        hashed at every look (an eval's 2,048 queued samples of a 2k-token prompt: ~100 ms an admitting step)."""
        if not self.prefix_sharing or seq.output_ids or len(seq.prompt_ids) < 2:
            return None
        if seq.prompt_key is None:
            seq.prompt_key = array("q", seq.prompt_ids).tobytes()
        return seq.prompt_key

    def _sibling_run(self, seq: Sequence) -> int:
        """How many fresh requests with `seq`'s prompt head the queue (`seq` first), at most an eighth of
        the slots."""
        n, key = 1, self._share_key(seq)
        while n < min(len(self.waiting), max(1, self.max_num_seqs // 8)):
            if self._share_key(self.waiting[n]) != key:  # None for one with tokens: not fresh
                break
            n += 1
        return n

    @staticmethod
    def _holds_prompt(parent: Sequence) -> bool:
        """Still running with exactly its prompt cached (not preempted, finished or decoded since)."""
        return parent.status is Status.RUNNING and parent.num_cached_tokens == len(parent.prompt_ids)

    def _fork(self, seq: Sequence, parent: Sequence, shared: int) -> None:
        """Give `seq` the parent's prompt KV up to its last prompt token, which `seq` computes itself."""
        bs = self.blocks.block_size
        last = len(seq.prompt_ids) - 1
        self.blocks.share(seq, parent.block_table[:shared])
        self.blocks.grow(seq, len(seq))  # the private block that holds position `last`
        seq.num_cached_tokens = last
        src, dst = parent.block_table[shared] * bs, seq.block_table[shared] * bs
        copied = range(last - shared * bs)  # offsets of the shared positions in that block
        seq.fork = PrefixFork([src + i for i in copied], [dst + i for i in copied], parent.seq_slot, seq.seq_slot)
        self.num_forks += 1
        self.prefill_tokens_saved += last

    def forget_prefixes(self) -> None:
        """New weights: prompt KV computed under the old ones must not seed new requests. A new request
        still prefilling its prompt in chunks starts that prompt over, so its KV and the response it
        begins are of the new weights alone (with its first chunks kept, a follower forked the mixed KV,
        and the response's tokens carried the new version over an older prompt)."""
        self._prefix_parents = {}
        self._chunking = {}
        for seq in reversed(list(self.running)):  # appendleft in reverse keeps their queue order
            if not seq.output_ids and 0 < seq.num_cached_tokens < len(seq.prompt_ids):
                self._release(seq)
                seq.status = Status.WAITING  # `_release` freed its blocks and cached count
                self.waiting.appendleft(seq)

    def _decode_batch(self, skip: frozenset[int] | set[int] = frozenset()) -> list[Sequence]:
        batch: list[Sequence] = []
        block_size = self.blocks.block_size
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if skip and id(seq) in skip:
                i += 1
                continue
            if len(seq.block_table) * block_size >= len(seq):
                batch.append(seq)  # its blocks already cover it: most sequences at most steps
                i += 1
                continue
            while not self.blocks.can_grow(seq, len(seq)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, len(seq))
                batch.append(seq)
                i += 1
        return batch

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self._free_seq_slots.append(seq.seq_slot)
        seq.seq_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Preempt every running sequence, keeping their queue order ahead of the waiting ones."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request; a finished one keeps its finish reason (nothing to abort)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self._release(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._release(seq)

    def stop_reason(self, seq: Sequence, stop_ids: frozenset[int]) -> str | None:
        """Why `seq` should stop after its newest token, or None to continue."""
        if not seq.params.ignore_eos and seq.output_ids and seq.output_ids[-1] in stop_ids:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None
