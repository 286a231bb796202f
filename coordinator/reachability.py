"""Whether a node's Stage address answers: the coordinator dials it, as a neighbour would.

Used at ``Join`` (is the announced address reachable from outside, or is the node behind NAT or a
firewall?) and after a failure report (is the accused neighbour still alive?). The dial uses the
run's TLS with the name every node certificate holds, so a port that answers but is no swarm
node's does not count. A port that refuses the connection outright has nothing listening: the
process that served there is gone (a frozen or overloaded one still completes the handshake).
"""

from __future__ import annotations

import asyncio
import secrets

import grpc

from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.net.channel import open_channel
from swarm.net.netaddr import split_host_port
from swarm.net.tls import NODE_SERVER_NAME, Security


async def ping(address: str, security: Security, timeout: float) -> str:
    """Why a Stage service at ``address`` did not answer a Ping within ``timeout`` seconds ("" if it did)."""
    nonce = secrets.randbits(63)
    async with open_channel(address, security, server_name=NODE_SERVER_NAME) as channel:
        try:
            call = stage_pb2_grpc.StageStub(channel).Ping(stage_pb2.PingRequest(nonce=nonce), timeout=timeout)
            reply = await asyncio.wait_for(call, timeout + 1)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        except TimeoutError:
            return f"no answer within {timeout:g}s"
    return "" if reply.nonce == nonce else "the answer did not echo the Ping"


async def refused(address: str, timeout: float) -> bool:
    """Whether ``address`` refuses a TCP connection within ``timeout`` seconds (nothing listens there);
    False when it accepts, or stays silent (a filter, a frozen host: no verdict)."""
    try:
        host, port = split_host_port(address)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    return False
