"""Leader names of `meshllm generate --peer` runs (commands/leader_slot.py): runs at once are
different leaders, runs one after another the same one, whatever the host's name."""

from __future__ import annotations

import os
import socket

import pytest

from meshllm.commands import leader_slot as slots
from meshllm.transport.convert import node_id_text


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "desk mini\u00e9")  # this machine's name is plain
    return "desk_mini_"


def test_runs_at_once_are_different_leaders_and_one_after_another_the_same(tmp_path, host):
    first, first_lock = slots.leader_slot(tmp_path)
    second, second_lock = slots.leader_slot(tmp_path)  # while the first runs
    token = (tmp_path / "generate-leader-id").read_text()
    try:
        assert (first, second) == (f"meshllm-generate-{host}-{token}-0", f"meshllm-generate-{host}-{token}-1")
        first_lock.close()  # the first run ends
        again, again_lock = slots.leader_slot(tmp_path)
        again_lock.close()
        assert again == first
        for leader_id in (first, second):  # names the nodes accept for a Load's leader and a card
            assert node_id_text(leader_id, "leader id") == leader_id
    finally:
        first_lock.close()
        second_lock.close()


def test_two_state_directories_on_one_host_are_different_leaders(tmp_path, host):
    # two users, or two containers sharing the host's name: each state directory has its own token
    mine, my_lock = slots.leader_slot(tmp_path / "a")
    theirs, their_lock = slots.leader_slot(tmp_path / "b")
    my_lock.close()
    their_lock.close()
    assert mine.endswith("-0") and theirs.endswith("-0") and mine != theirs


def test_without_a_slot_a_run_is_named_by_its_process(tmp_path, host, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    alone, lock = slots.leader_slot(tmp_path / "file" / "state")  # no state directory can be made
    assert alone == f"meshllm-generate-{host}-pid{os.getpid()}" and lock is None
    assert "no leader slot" in caplog.text
    monkeypatch.setattr(slots, "MAX_SLOTS", 1)
    held, held_lock = slots.leader_slot(tmp_path / "state")
    try:
        assert slots.leader_slot(tmp_path / "state") == (alone, None)  # every slot taken
        assert "leader slots" in caplog.text and "are taken" in caplog.text
    finally:
        held_lock.close()
    (tmp_path / "state" / "generate-leader-id").write_text("not a token")
    assert slots.leader_slot(tmp_path / "state") == (alone, None)  # a damaged token file: no guessing
