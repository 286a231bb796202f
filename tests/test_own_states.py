"""A node's own states of its stages' latest steps: what an epoch that goes on after a replica's
death (or a replica joining at a cut) restores from instead of a snapshot."""

from __future__ import annotations

import torch
from swarm.node.own_states import OwnStates

from swarm.io import checkpoint
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def test_keeps_the_newest_steps_per_stage_and_forgets_an_abandoned_history():
    own = OwnStates(keep=2)
    for step in range(4):
        for stage in (0, 1):
            own.put({"stage": stage, "step": step, "weights": torch.full((2,), float(step))})
    assert own.take(0, 1, "cpu") is None  # beyond the newest two
    assert torch.equal(own.take(1, 3, "cpu")["weights"], torch.full((2,), 3.0))
    own.forget_from(3)  # an epoch resuming at step 3 redoes it: the kept step 3 is another history
    assert own.take(0, 3, "cpu") is None and own.take(1, 2, "cpu") is not None


def test_a_stage_restored_from_its_own_state_trains_on_as_if_never_rebuilt():
    """Capture a worker after two steps; a freshly built worker restored from the kept state takes
    the third step bit for bit as the original, and training it leaves the kept state untouched."""
    config = tiny_config(n_stages=1, forward_format="fp32", backward_format="fp32")
    original = LocalPipeline(config)
    for step in range(2):
        original.train_step(step, random_batch(config, seed=step))
    own = OwnStates()
    own.put(checkpoint.capture(original.workers[0], 1))
    kept = {k: v.clone() for k, v in own.take(0, 1, "cpu")["model"].items()}

    rebuilt = LocalPipeline(config)
    assert checkpoint.restore(rebuilt.workers[0], own.take(0, 1, "cpu")) == 1
    a = original.train_step(2, random_batch(config, seed=2)).loss
    b = rebuilt.train_step(2, random_batch(config, seed=2)).loss
    assert a == b
    for p, q in zip(original.workers[0].parameters(), rebuilt.workers[0].parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(torch.equal(v, kept[k]) for k, v in own.take(0, 1, "cpu")["model"].items())
