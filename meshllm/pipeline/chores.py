"""Work for every stage that rides on the leader's next step: sequences to free and
prefix-cache blocks to keep or drop. Owned by the leader's loop thread."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import Publish


@dataclass
class StageChores:
    release: list[SeqId] = field(default_factory=list)
    publish: list[Publish] = field(default_factory=list)  # stages apply evict, then publish, then release
    evict: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.release or self.publish or self.evict)

    def keep(self, publish: Publish) -> None:
        """Have the stages keep these blocks; cancels a pending eviction of the same blocks."""
        dropped = set(publish.hashes)
        self.evict = [h for h in self.evict if h not in dropped]
        self.publish.append(publish)

    def drop(self, hashes: Iterable[int]) -> None:
        """Have the stages drop these blocks; cancels a pending publication of the same blocks.

        The two lists stay disjoint, so the order the stages apply them in cannot matter.
        """
        dropped = set(hashes)
        if not dropped:
            return
        self.publish = [p for p in self.publish if not dropped.intersection(p.hashes)]
        self.evict.extend(dropped)

    def take(self) -> tuple[tuple[SeqId, ...], tuple[Publish, ...], tuple[int, ...]]:
        """(release, publish, evict) for the next step; empties the lists."""
        taken = tuple(self.release), tuple(self.publish), tuple(self.evict)
        self.release, self.publish, self.evict = [], [], []
        return taken
