"""The load gate in one process (threads as ranks, rank 0's real TCPStore on loopback): ranks
go on together once all loaded, and one failure, reported by the rank or by the leader for a
node that never answered, ends the others' wait at once, naming the rank."""

from __future__ import annotations

import threading
import time

import pytest

from meshllm.errors import TensorParallelAborted, TensorParallelFailed
from meshllm.tp.group import RankRole, StoreHost
from meshllm.tp.load_gate import LoadGate, report_failure


def _roles(store: StoreHost, group: str, size: int) -> list[RankRole]:
    return [RankRole(r, size, store.endpoint, group) for r in range(size)]


def test_every_rank_goes_on_once_all_have_loaded(store):
    roles = _roles(store, "all-loaded", 3)
    gates = [LoadGate(role, store) for role in roles]
    done = []

    def rank(gate: LoadGate, delay_s: float) -> None:
        time.sleep(delay_s)
        gate.loaded()
        gate.wait_for_all(10)
        done.append(gate.role.rank)

    threads = [threading.Thread(target=rank, args=(g, 0.1 * i)) for i, g in enumerate(gates)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert sorted(done) == [0, 1, 2]


@pytest.mark.parametrize("reporter", ["the rank", "the leader"])
def test_a_failed_rank_ends_the_others_wait_at_once(store, reporter):
    role0, role1 = _roles(store, f"failing-{reporter[4:]}", 2)
    gate0 = LoadGate(role0, store)
    gate0.loaded()
    started = time.monotonic()
    # Rank 1's node reports its own failure (through its own connection), or the leader does for it.
    threading.Timer(0.3, lambda: report_failure(store.endpoint, role1.group_id, 1,
                                                f"node n1: reported by {reporter}")).start()
    with pytest.raises(TensorParallelAborted, match=f"rank 1 of 2 failed its Load \\(node n1: reported by {reporter}"):
        gate0.wait_for_all(60)
    assert time.monotonic() - started < 2.0


def test_a_rank_that_never_reports_times_out_with_its_number(store):
    gate0 = LoadGate(_roles(store, "silent", 2)[0], store)
    gate0.loaded()
    with pytest.raises(TensorParallelFailed, match=r"rank\(s\) \[1\] did not finish loading"):
        gate0.wait_for_all(0.3)
