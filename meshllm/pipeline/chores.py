"""Work for every stage that rides on the leader's next step: sequences to free and
prefix-cache blocks to keep or drop. Owned by the leader's loop thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import Publish


@dataclass
class StageChores:
    release: list[SeqId] = field(default_factory=list)
    publish: list[Publish] = field(default_factory=list)  # applied first, then evict, then release
    evict: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.release or self.publish or self.evict)

    def take(self) -> tuple[tuple[SeqId, ...], tuple[Publish, ...], tuple[int, ...]]:
        """(release, publish, evict) for the next step; empties the lists."""
        taken = tuple(self.release), tuple(self.publish), tuple(self.evict)
        self.release, self.publish, self.evict = [], [], []
        return taken
