"""The thread that unloads a replaced plan's stages may still be calling when the process closes
its channel pool (seen in the suite: an unhandled "Cannot invoke RPC on closed channel!" in thread
unload-stale). It stops quietly then; the nodes drop the plan when its lease lapses."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.transport.channels import ChannelConfig, ChannelPool


def test_unloading_stale_plans_stops_quietly_once_the_pool_is_closed():
    pool = ChannelPool(ChannelConfig("leader", os.urandom(32)))
    address = "127.0.0.1:9"  # nothing is reached: the channel is closed before any call
    channel = pool.get(address, "node-1")  # handed out just before the close, as in the race
    pool.close()
    stale = {(address, "node-1", "plan-a"), (address, "node-2", "plan-a")}
    # The method's state only: a whole PlanOwner needs a cluster, and the race needs none.
    owner = SimpleNamespace(_lock=threading.Lock(), _stale=set(stale), leader_id="leader-a",
                            channels=SimpleNamespace(get=lambda a, n=None: channel))
    PlanOwner._unload_stale(owner)  # raised ValueError before
    assert owner._stale == stale  # still stale: nothing was unloaded
