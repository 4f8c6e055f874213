"""Runs micro-batches through one stage's layers: checks the input, keeps the KV
cache, and on the last stage samples so only token ids travel back.

Called by the stage service (one step at a time, under its lock) and by the
in-process pipeline used for single-process generation: both share this code,
so a distributed run and a local run do the same arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from meshllm.engine.kv_cache import LOCAL_OWNER, KVCache, Owner, SeqId
from meshllm.engine.prefix_store import MissingBlock, PrefixStore
from meshllm.engine.step import SampledToken, Step
from meshllm.engine.step_limits import DEFAULT_PREFIX_BLOCKS
from meshllm.errors import MalformedMessage, MeshError, PlanLimitExceeded, ShardCorrupt
from meshllm.model.decoder import Decoder, SeqSlice
from meshllm.spec.verify import choose_tokens


class KVMissing(MeshError):
    """A step asked to continue a sequence from a position this stage never computed."""

    code = "kv_missing"


class StageRunner:
    def __init__(self, decoder: Decoder, kv_dtype: torch.dtype | None = None,
                 prefix_capacity_blocks: int = DEFAULT_PREFIX_BLOCKS, samples: bool = True,
                 max_context: int | None = None):
        """`max_context`: the plan's context, where a sequence's cache stops growing (by doubling it
        would reach the next power of two, past what the plan budgets and the node reserves)."""
        self.decoder = decoder
        # False on the non-zero ranks of a tensor-parallel group: they compute, rank 0 samples.
        self.samples = samples
        layout = decoder.kv_layout(kv_dtype)
        if max_context is not None and (layout.max_tokens is None or max_context < layout.max_tokens):
            layout = replace(layout, max_tokens=max_context)
        self.cache = KVCache(layout)
        self.prefix = PrefixStore(prefix_capacity_blocks)  # the leader's index holds no more than this

    @property
    def is_first(self) -> bool:
        return self.decoder.has_embedding

    @property
    def is_last(self) -> bool:
        return self.decoder.has_head

    def release(self, seq_ids, owner: Owner | None = None) -> int:
        """Free these sequences (with an owner, only the ones it holds); returns how many."""
        return sum(self.cache.release(s, owner) for s in seq_ids)

    def release_owner(self, owner: Owner) -> tuple[int, int]:
        """Free every sequence and prefix block `owner` holds (its stream ended): (sequences, blocks)."""
        return self.release(self.cache.owned_by(owner)), self.prefix.drop_owner(owner)

    def run(self, step: Step, owner: Owner = LOCAL_OWNER, max_held: int | None = None) -> Tensor | list[SampledToken]:
        """Hidden states [tokens, hidden] for the next stage, or sampled tokens on the last.

        `owner` is the stream the step came on: it may release and evict only what it holds, and
        holds every sequence of the step afterwards; with `max_held` (the plan's batch), a step
        that would leave it holding more sequences is refused before anything is computed.
        """
        # A sequence this plan adopted after a failover is claimed by the first work naming it
        # (kv_carry.skip_carried); a stage before this one that had every row of that work carried
        # drops the work, so here the step may name it only to publish or release it.
        if step.publish or step.release:
            for seq_id in {p.seq_id for p in step.publish}.union(step.release):
                self.cache.claim(seq_id, owner)
        # Evictions before publications: the leader's index evicted to make room for them, and
        # the chores it sends never evict and publish the same block (pipeline/chores.py).
        self.prefix.evict(step.evict, owner)
        for p in step.publish:  # before release: a sequence may publish and finish in one step
            if self.cache.owner_of(p.seq_id) == owner:
                self.prefix.publish(self.cache.sequences[p.seq_id], p.first_block, p.hashes, step.block_size, owner)
        self.release(step.release, owner)
        if not step.seqs:
            return [] if self.is_last else step.input
        if max_held is not None:
            self._check_held(step, owner, max_held)
        x = self._checked_input(step)
        slices, positions, row = [], [], 0
        context = self.decoder.config.max_position_embeddings
        for work in step.seqs:
            if work.start + work.num_tokens > context:
                raise MalformedMessage(f"sequence {work.seq_id} reaches position {work.start + work.num_tokens}, "
                                       f"beyond the model's context of {context}")
            kv = self.cache.get_or_allocate(work.seq_id, owner)
            if work.attach:
                try:
                    self.prefix.attach(kv, work.attach, owner)
                except MissingBlock:
                    raise KVMissing(f"sequence {work.seq_id} attaches a prefix block this stage does not "
                                    f"hold; re-prefill it") from None
            if work.start > kv.length:
                raise KVMissing(f"sequence {work.seq_id} continues at position {work.start} but this stage "
                                f"holds only {kv.length} tokens of it; re-prefill it")
            if work.start < kv.length:
                kv.truncate(work.start)  # rollback: rejected draft tokens or a replayed step
            slices.append(SeqSlice(kv, row, work.num_tokens))
            positions.append(np.arange(work.start, work.start + work.num_tokens))
            row += work.num_tokens
        scored = [w for w in step.seqs if w.num_scored]
        logit_rows = None
        if self.is_last:
            # The last num_scored rows of each scored sequence, in batch order.
            logit_rows = torch.tensor([r for s, w in zip(slices, step.seqs) if w.num_scored
                                       for r in range(s.row + s.num_tokens - w.num_scored, s.row + s.num_tokens)],
                                      dtype=torch.long)
        # numpy for the small per-step bookkeeping: torch's per-op dispatch costs several times more,
        # and on a small model these run on caches the last step's weights just swept.
        out = self.decoder(x, torch.from_numpy(np.concatenate(positions)), slices, logit_rows)
        out = out.cpu()  # no-op on cpu; from --device
        if not self.is_last:
            return out
        return choose_tokens(out, scored) if self.samples else []

    def _checked_input(self, step: Step) -> Tensor:
        # Everything here came from a peer: check before use (DESIGN.md "Wire protocol").
        x, n = step.input, step.num_tokens
        if self.is_first:
            if x.dtype != torch.int64 or x.shape != (n,):
                raise ShardCorrupt(f"first stage expects token ids int64[{n}], got {x.dtype}{list(x.shape)}")
            vocab = self.decoder.config.vocab_size
            if n <= 64:  # a decode step's few ids: plain Python beats any array op's dispatch
                ids = x.tolist()
                low, high = min(ids), max(ids)
            else:
                ids = x.numpy()
                low, high = ids.min(), ids.max()
            if low < 0 or high >= vocab:
                raise ShardCorrupt(f"token id out of range [0, {vocab})")
            return x
        hidden = self.decoder.config.hidden_size
        if not x.is_floating_point() or x.shape != (n, hidden):
            raise ShardCorrupt(f"expected hidden states float[{n}, {hidden}], got {x.dtype}{list(x.shape)}")
        finite = np.isfinite(x.numpy()).all() if x.dtype == torch.float32 else torch.isfinite(x).all()
        if not bool(finite):
            raise ShardCorrupt("received activations contain NaN or Inf; the previous stage is faulty")
        return x

    def _check_held(self, step: Step, owner: Owner, max_held: int) -> None:
        held = set(self.cache.owned_by(owner))
        num_new = sum(1 for w in step.seqs if w.seq_id not in held)
        if len(held) + num_new > max_held:
            raise PlanLimitExceeded(f"this stream would hold {len(held) + num_new} sequences on this stage; the "
                                    f"plan's batch is {max_held}. Release finished sequences first.")

    def held_sequences(self) -> list[SeqId]:
        return sorted(self.cache.sequences)
