"""KV cache of one stage: per sequence, the keys and values of the stage's layers.

Each sequence owns contiguous tensors that grow by doubling, so attention reads
one strided view per layer with no gather. `length` counts committed tokens;
rolling back (speculative decoding, failover re-prefill) is `truncate`.

After a failover a sequence may outlive the stream that computed it: parked (owned by nobody,
until a deadline) so that the re-planned plan's stage over the same weights can adopt it
(pipeline/kv_parking.py) and skip re-computing the `carried` positions it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

import torch
from torch import Tensor

SeqId = NewType("SeqId", int)
# Who holds a sequence's KV on a stage: one leader's Forward stream (stage_forward.py), so the
# stage frees it when that stream ends. In-process pipelines have a single owner.
Owner = NewType("Owner", int)
LOCAL_OWNER = Owner(0)
PARKED = Owner(-1)  # no stream holds it: kept until its deadline for a re-planned plan to adopt

_MIN_CAPACITY = 64
# Caches off the CPU start zeroed: a decode step replayed as a CUDA graph (engine/cuda_graphs.py)
# attends over a cache's whole capacity with the unwritten positions masked, and a masked weight
# of 0 times uninitialized memory that holds a NaN is still NaN. A GPU memset is nearly free; on
# the CPU no step reads past a sequence's length, and untouched pages cost no memory, so there it
# is off (tests of that static step on the CPU turn it on).
ZERO_FILL_ON_CPU = False


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_key_value_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    max_tokens: int | None = None  # the model's context: growth by doubling stops here

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim * self.dtype.itemsize


class SequenceKV:
    """Keys and values of one sequence for a contiguous range of layers.

    k, v: [num_layers, num_key_value_heads, capacity, head_dim]
    """

    def __init__(self, layout: KVLayout, capacity: int = _MIN_CAPACITY):
        self.layout = layout
        self.length = 0
        # Positions [0, carried) came from an earlier plan's stage (a failover): a step that starts
        # below it need not compute them again here (engine/kv_carry.py). 0: nothing carried.
        self.carried = 0
        self.k = self._empty(capacity)
        self.v = self._empty(capacity)

    def _empty(self, capacity: int) -> Tensor:
        lay = self.layout
        make = torch.empty if lay.device.type == "cpu" and not ZERO_FILL_ON_CPU else torch.zeros
        return make(lay.num_layers, lay.num_key_value_heads, capacity, lay.head_dim, dtype=lay.dtype, device=lay.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` in total; called before a forward writes them."""
        if num_tokens <= self.capacity:
            return
        doubled = 2 * self.capacity
        if self.layout.max_tokens is not None:
            doubled = min(doubled, self.layout.max_tokens)  # never hold more than a full context
        capacity = max(num_tokens, doubled)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self._empty(capacity)
            new[:, :, : self.length].copy_(old[:, :, : self.length])
            setattr(self, name, new)

    def truncate(self, length: int) -> None:
        """Forget every token at position >= length (rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token sequence to {length}")
        self.length = length

    def copy_prefix_from(self, k: Tensor, v: Tensor) -> None:
        """Start this sequence from cached prefix keys/values ([layers, heads, n, dim])."""
        n = k.shape[2]
        self.reserve(n)
        self.k[:, :, :n].copy_(k)
        self.v[:, :, :n].copy_(v)
        self.length = n

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KVCache:
    """All sequences of one stage, keyed by sequence id; lifetime set by the leader, and bounded
    by its stream: each sequence belongs to the owner that last computed it."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.sequences: dict[SeqId, SequenceKV] = {}
        self._owners: dict[SeqId, Owner] = {}
        self._parked_until: dict[SeqId, float] = {}  # monotonic deadline of each parked sequence

    def get_or_allocate(self, seq_id: SeqId, owner: Owner = LOCAL_OWNER) -> SequenceKV:
        seq = self.sequences.get(seq_id)
        if seq is None:
            seq = self.sequences[seq_id] = SequenceKV(self.layout)
        self._owners[seq_id] = owner
        self._parked_until.pop(seq_id, None)  # a stream computes it again: it owns it now
        return seq

    def release(self, seq_id: SeqId, owner: Owner | None = None) -> bool:
        """Free a sequence; with an owner, only if that owner holds it."""
        if seq_id not in self.sequences or (owner is not None and self._owners[seq_id] != owner):
            return False
        del self.sequences[seq_id], self._owners[seq_id]
        self._parked_until.pop(seq_id, None)
        return True

    def claim(self, seq_id: SeqId, owner: Owner) -> bool:
        """`owner`'s stream takes a parked sequence it names (one its plan adopted): it then holds
        it, may publish its blocks and frees it. False when the sequence is not parked."""
        if self._owners.get(seq_id) != PARKED:
            return False
        self._owners[seq_id] = owner
        self._parked_until.pop(seq_id, None)
        return True

    def park(self, owner: Owner, until: float) -> int:
        """`owner`'s stream ended after a failure: keep its sequences, owned by nobody, until the
        monotonic time `until` (drop_expired frees them then). Returns how many."""
        seq_ids = self.owned_by(owner)
        for seq_id in seq_ids:
            self._owners[seq_id] = PARKED
            self._parked_until[seq_id] = until
        return len(seq_ids)

    def drop_expired(self, now: float) -> int:
        """Free parked sequences whose deadline passed; returns how many."""
        expired = [s for s, until in self._parked_until.items() if until <= now]
        return sum(self.release(s) for s in expired)

    def take(self, seq_id: SeqId) -> SequenceKV | None:
        """Remove a sequence whoever holds it (to move it to another plan's cache)."""
        if seq_id not in self.sequences:
            return None
        kv = self.sequences[seq_id]
        self.release(seq_id)
        return kv

    def put_parked(self, seq_id: SeqId, kv: SequenceKV, until: float) -> None:
        """Hold `kv` (adopted from another plan, same layout) parked until a stream computes it."""
        if kv.layout != self.layout:
            raise ValueError(f"sequence {seq_id}: KV layout {kv.layout} differs from this cache's {self.layout}")
        self.sequences[seq_id] = kv
        self._owners[seq_id] = PARKED
        self._parked_until[seq_id] = until

    def owned_by(self, owner: Owner) -> list[SeqId]:
        return [s for s, o in self._owners.items() if o == owner]

    def owner_of(self, seq_id: SeqId) -> Owner | None:
        return self._owners.get(seq_id)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.sequences

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_bytes(self) -> int:
        # A copy first: the node's card reads this from the gossip thread while a step adds sequences.
        return sum(s.num_bytes for s in list(self.sequences.values()))
