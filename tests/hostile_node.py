"""A volunteer that turns hostile: ``python -m tests.hostile_node ATTACK FROM_STEP join ...``.

It runs the real node daemon (``swarm.node.cli``, every argument after ``FROM_STEP``) with its
boundary sends wrapped: from step ``FROM_STEP`` on, every activation frame it sends carries
NaN coordinates (``nan``), twice the rows its shape says (``oversized``), finite bf16
coordinates scaled up 10^4 times (``scaled``: only a norm bound catches it), or goes out twice
(``replay``). Everything else about it is an honest node.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from swarm.node import cli, links

from swarm.runtime.wire import ActivationFrame

ATTACKS = ("nan", "oversized", "scaled", "replay")


def turn_hostile(attack: str, from_step: int) -> None:
    if attack not in ATTACKS:
        raise SystemExit(f"unknown attack {attack!r}; choose from {ATTACKS}")
    honest_send = links.StageLink.send

    async def send(self: links.StageLink, item) -> int:
        if not isinstance(item, ActivationFrame) or item.step < from_step:
            return await honest_send(self, item)
        payload = item.payload
        if attack == "nan":  # float32 NaN / bf16 NaN bit patterns, whatever the format
            item = replace(item, payload=replace(payload, data=b"\xc0\x7f" * (len(payload.data) // 2)))
        elif attack == "scaled":  # bf16 payloads (the test runs' format)
            scaled = torch.frombuffer(bytearray(payload.data), dtype=torch.bfloat16) * 1e4
            item = replace(item, payload=replace(payload, data=scaled.view(torch.uint8).numpy().tobytes()))
        elif attack == "oversized":
            item = replace(item, payload=replace(payload, rows=2 * payload.rows, data=2 * payload.data))
        sent = await honest_send(self, item)
        if attack == "replay":
            sent += await honest_send(self, item)
        return sent

    links.StageLink.send = send


if __name__ == "__main__":
    attack, from_step, *node_args = sys.argv[1:]
    turn_hostile(attack, int(from_step))
    sys.exit(cli.main(node_args))
