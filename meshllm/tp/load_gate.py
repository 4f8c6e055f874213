"""Every rank of a group says whether it loaded its slices before any rank joins the group.

Joining (the backend's rendezvous, in C++) blocks until every rank has joined or the
rendezvous timeout ends (minutes: ranks load at their disks' speed), so a rank whose Load
failed would leave the others waiting that long, and the leader's deploy with them. So each
rank first writes its outcome in rank 0's store, under a prefix of its own group id:
`<rank>` = "" once its slices are in memory, or the reason it failed. Every rank then polls
(a cheap `check`) until all have loaded, and stops at the first failure it sees, naming the
rank and its node. The leader writes the failure of a rank whose node did not answer its
Load at all (pipeline/deploy.py), so even a crashed node fails its group in seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator

from torch.distributed import PrefixStore, TCPStore

from meshllm.errors import TensorParallelAborted, TensorParallelFailed
from meshllm.tp.group import RankRole, StoreHost

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # rank 0's store runs with its node: if it does not answer, the group cannot form
REPORT_TIMEOUT_S = 2.0  # a failure report is best effort: the Load's own error goes back anyway
POLL_S = 0.05
LOADED = b""


def _prefixed(store, group_id: str) -> PrefixStore:
    return PrefixStore(f"meshllm/tp-load/{group_id}", store)


def _connect(store_address: str, timeout_s: float) -> TCPStore:
    host, _, port = store_address.rpartition(":")
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class LoadGate:
    """One rank's view of its group's load outcomes (rank 0 uses the store its node hosts)."""

    def __init__(self, role: RankRole, hosted: StoreHost | None):
        self.role = role
        try:
            if role.rank == 0 and hosted is not None and hosted.store is not None:
                store = hosted.client(CONNECT_TIMEOUT_S)  # its own connection: see StoreHost.client
            else:
                store = _connect(role.store_address, CONNECT_TIMEOUT_S)
        except (RuntimeError, OSError, ValueError) as e:
            raise TensorParallelFailed(f"rank {role.rank} of {role.size} cannot reach rank 0's store at "
                                       f"{role.store_address} ({_first_line(e)}); is rank 0's node up?") from None
        self._store = _prefixed(store, role.group_id)

    def loaded(self) -> None:
        self._store.set(str(self.role.rank), LOADED)

    def wait_for_all(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Until every rank has loaded; TensorParallelAborted at the first that failed, naming it.

        `cancelled` is polled too: an Unload of the plan while its group forms ends this rank's
        wait at once (TensorParallelFailed, which its node reports to the other ranks)."""
        deadline = time.monotonic() + timeout_s
        waiting = [r for r in range(self.role.size) if r != self.role.rank]
        while waiting:
            if cancelled():
                raise TensorParallelFailed(f"tensor-parallel group {self.role.group_id}: rank {self.role.rank}'s "
                                           f"plan was unloaded while the group formed")
            try:
                for rank in list(waiting):
                    if not self._store.check([str(rank)]):
                        continue
                    reason = self._store.get(str(rank)).decode(errors="replace")
                    if reason:
                        raise TensorParallelAborted(
                            f"tensor-parallel group {self.role.group_id}: rank {rank} of {self.role.size} failed "
                            f"its Load ({reason}); this rank ({self.role.rank}) leaves the group unformed")
                    waiting.remove(rank)
            except RuntimeError as e:  # rank 0's store went away (its node died)
                raise TensorParallelFailed(f"tensor-parallel group {self.role.group_id}: rank 0's store at "
                                           f"{self.role.store_address} is gone ({_first_line(e)})") from None
            if waiting and time.monotonic() > deadline:
                raise TensorParallelFailed(f"tensor-parallel group {self.role.group_id}: rank(s) {waiting} did not "
                                           f"finish loading within {timeout_s:.0f}s")
            if waiting:
                time.sleep(POLL_S)


def report_failure(store_address: str, group_id: str, rank: int, reason: str, hosted: StoreHost | None = None,
                   timeout_s: float = REPORT_TIMEOUT_S) -> bool:
    """Tell the group's other ranks that `rank` will not join (best effort); True if it was written."""
    reason = reason.strip() or "failed"
    try:
        store = hosted.client(timeout_s) if hosted is not None and hosted.store is not None else _connect(
            store_address, timeout_s)
        _prefixed(store, group_id).set(str(rank), reason.encode()[:2000])
        return True
    except (RuntimeError, OSError, ValueError) as e:
        log.info("could not report rank %d's failed Load to group %s at %s: %s", rank, group_id, store_address,
                 _first_line(e))
        return False


@contextlib.contextmanager
def failures_reported(role: RankRole, hosted: StoreHost | None, node_name: str) -> Iterator[None]:
    """Any error inside (reading the files, loading, joining) is reported to the group, then re-raised;
    an abort caused by another rank is not (that rank reported its own reason)."""
    try:
        yield
    except TensorParallelAborted:
        raise
    except Exception as e:
        report_failure(role.store_address, role.group_id, role.rank,
                       f"node {node_name}: {type(e).__name__}: {_first_line(e)}",
                       hosted if role.rank == 0 else None)
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
