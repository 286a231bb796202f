"""A stage replica whose machine dies: ``python -m tests.dying_node WHEN STEP join ...``.

It runs the real node daemon (``swarm.node.cli``, every argument after ``STEP``) in its own process
group, and at step ``STEP`` (or its first step after it, when it became a replica later) of a
stage it hosts as a replica it SIGKILLs that group (itself and
its P2P daemon, as a power cut would): mid-``forward`` (while computing its second microbatch of
the step) or mid-``averaging`` (right after sending its first part of the all-reduce round).
"""

from __future__ import annotations

import os
import signal
import sys

from swarm.node import cli, schedule

from swarm.runtime import averaging


def die() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


def die_at(when: str, step: int) -> None:
    if when == "forward":
        honest_compute = schedule.StageRunner._compute

        async def compute(self: schedule.StageRunner, kind: str, fn, *args):
            if self.averaging is not None and kind == "forward" and args[0] >= step and self._forwarded:
                die()
            return await honest_compute(self, kind, fn, *args)

        schedule.StageRunner._compute = compute
    elif when == "averaging":
        honest_generate = averaging._Runner._generate_input_for_peer

        async def generate(self: averaging._Runner, peer_index: int):
            async for message in honest_generate(self, peer_index):
                yield message
                if int(self.round.key.rsplit("/", 1)[1]) >= step:  # the per-step round "{stage key}/{step}"
                    die()

        averaging._Runner._generate_input_for_peer = generate
    else:
        raise SystemExit(f"unknown moment {when!r}; choose forward or averaging")


if __name__ == "__main__":
    os.setpgrp()  # its own group: the kill takes its P2P daemon too, and nothing else
    when, step, *node_args = sys.argv[1:]
    die_at(when, int(step))
    sys.exit(cli.main(node_args))
