"""The chaos monkey's choices: one stage host, or a middle stage with its keepers; at most N times."""

from __future__ import annotations

import pytest

from swarm.launch.chaos import ChaosMonkey

NODES = {"a": [0], "b": [1], "b2": [1], "c": [2], "spare": []}


def test_node_scope_kills_one_stage_host_never_a_standby():
    monkey = ChaosMonkey(every_s=0, seed=1)
    picked = {name for _ in range(50) for name in monkey.pick(NODES, 3)}
    assert picked == {"a", "b", "b2", "c"}
    assert all(len(monkey.pick(NODES, 3)) == 1 for _ in range(5))


def test_stage_scope_kills_every_host_of_a_middle_stage_and_every_standby():
    monkey = ChaosMonkey(every_s=0, scope="stage")
    assert monkey.pick(NODES, 3) == ["b", "b2", "spare"]
    assert monkey.pick({"a": [0], "c": [1]}, 2) == []  # no middle stage


def test_events_bound_the_kills():
    monkey = ChaosMonkey(every_s=0, events=2)
    assert monkey.due()
    monkey.pick(NODES, 3)
    monkey.pick(NODES, 3)
    assert not monkey.due()
    with pytest.raises(ValueError, match="scope"):
        ChaosMonkey(every_s=1, scope="rack")


def test_a_kill_stays_due_until_someone_is_placed():
    monkey = ChaosMonkey(every_s=0, scope="stage", events=1)
    assert monkey.pick({"a": [], "b": []}, 3) == []  # nobody placed yet: no event spent
    assert monkey.due() and monkey.pick(NODES, 3) and not monkey.due()
