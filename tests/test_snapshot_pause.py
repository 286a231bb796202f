"""Snapshots never stall training: a cut costs only a copy to host memory; the rest is background work."""

from __future__ import annotations

import asyncio

import pytest
import torch
from swarm.node.checkpointer import Checkpointer

from swarm.io import checkpoint
from swarm.ops.metrics import Metrics
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


class SlowClient:
    """A coordinator client whose uploads wait until the test lets them through."""

    node_id = "n"

    def __init__(self):
        self.release = asyncio.Event()
        self.uploads: list[str] = []
        self.reports: list[tuple[int, int]] = []

    async def upload(self, key: str, data: bytes) -> None:
        await self.release.wait()
        self.uploads.append(key)

    def report(self, method: str, request) -> None:
        self.reports.append((request.checkpoint.stage, request.checkpoint.step))


def test_a_capture_is_a_host_copy_that_later_steps_leave_alone():
    config = tiny_config()
    pipe = LocalPipeline(config)
    pipe.train_step(0, random_batch(config, 0))
    state = checkpoint.capture(pipe.workers[1], 0)
    saved = checkpoint.to_bytes(state)
    pipe.train_step(1, random_batch(config, 1))
    assert checkpoint.to_bytes(state) == saved  # training on changed the stage, not its capture
    assert all(t.device.type == "cpu" for t in state["model"].values())


def test_training_goes_on_while_a_slow_upload_is_in_flight(tmp_path):
    config = tiny_config()
    pipe = LocalPipeline(config)
    states = [checkpoint.capture(w, 4) for w in pipe.workers]

    async def scenario() -> None:
        client = SlowClient()
        saver = Checkpointer(checkpoint.SnapshotStore(tmp_path), client, Metrics("node"))
        saver.submit(1, states, 0.002, upload=True)  # returns at once: nothing waits for the upload
        for step in range(2):  # the next steps train while the snapshot is being uploaded
            pipe.train_step(step, random_batch(config, step))
            await asyncio.sleep(0.05)
        assert client.uploads == [] and client.reports == []
        assert len(list(tmp_path.glob("stage*-step*.snap"))) == 1  # written, the upload still waits
        client.release.set()
        await asyncio.wait_for(saver.flush(), 30)
        await saver.close()
        assert client.reports == [(s, 4) for s in range(config.n_stages)]

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.gpu
def test_a_capture_on_cuda_lands_in_pinned_host_memory_with_equal_values():
    config = tiny_config()
    pipe = LocalPipeline(config, device=torch.device("cuda"))
    pipe.train_step(0, random_batch(config, 0))
    worker = pipe.workers[0]
    state = checkpoint.capture(worker, 0)
    for name, value in worker.stage.state_dict().items():
        assert state["model"][name].is_pinned()
        assert torch.equal(state["model"][name], value.cpu())
