"""Who a `meshllm generate --peer` run is to the nodes it calls: a leader name, and the lock that
keeps it this run's alone while it streams.

Nodes reserve KV per leader (pipeline/loaded_stages.py), and a plan outlives the run that loaded
it by its lease. One name for every run made two runs at once one leader, whose reservations
overlapped. A name per process made each run a new leader of the plan the last run left leased,
adding a context's KV to what the node reserves at every run. So a run takes the first free slot
of its state directory (an flock, held while it streams): runs one after another are the same
leader (slot 0: the plan warm, its KV counted once), runs at once are different leaders. The name
carries a random token made once per state directory, so two users, or two containers, on one
host are different leaders too, and the host, as the lock files do (a home shared over NFS).
(A second slot's claim on a plan lapses a lease after its run ends, though the first slot's runs
keep the plan: a node leases each leader's claim on its own.) Where no slot can be had (no writable state
directory, no flock, every slot taken), the process id names the run, as before the slots.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import socket
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

MAX_SLOTS = 64  # runs at once from one state directory; past them, runs are named by process id
_TOKEN = re.compile(r"^[0-9a-f]{12}$")


def leader_slot(state_dir: Path) -> tuple[str, IO[str] | None]:
    """This run's leader name and its slot's lock (None for a name by process id). Close the lock
    when the run's stream ends: the next run may then be the same leader."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:48]  # characters safe in a node id
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        token = _state_token(state_dir)
        for slot in range(MAX_SLOTS):
            lock = open(state_dir / f"generate-leader-{host}-{slot}.lock", "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another run holds it
                lock.close()
                continue
            except OSError:
                lock.close()
                raise
            return f"meshllm-generate-{host}-{token}-{slot}", lock
        reason = f"all {MAX_SLOTS} leader slots in {state_dir} are taken"
    except OSError as e:
        reason = f"no leader slot in {state_dir}: {e}"
    log.warning("%s; this run is a leader of its own until its plan's lease ends", reason)
    return f"meshllm-generate-{host}-pid{os.getpid()}", None


def _state_token(state_dir: Path) -> str:
    """The state directory's random token, made by the first run (atomically: two first runs at
    once read the same one)."""
    path = state_dir / "generate-leader-id"
    if not path.exists():
        made = state_dir / f".generate-leader-id.{os.getpid()}"
        made.write_text(secrets.token_hex(6))
        try:
            os.link(made, path)  # fails if another run made it first: theirs is kept
        except FileExistsError:
            pass
        finally:
            made.unlink()
    token = path.read_text().strip()
    if not _TOKEN.match(token):
        raise OSError(f"{path} does not hold a leader token")
    return token
