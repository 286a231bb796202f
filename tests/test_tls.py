"""TLS: `swarm certs`, a TLS coordinator that only the swarm's CA opens, mutual TLS, the CLI's refusals,
and a mutual-TLS swarm training end to end (real processes on loopback)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import stat
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from swarm.coordinator.service import CoordinatorServer, CoordinatorService
from swarm.coordinator.settings import CoordinatorSettings
from swarm.node.links import LinkError, PlannedPeer, dial
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2_grpc
from swarm.net import certs, tls
from swarm.net.credentials import session_metadata
from swarm.net.frames import PROTOCOL_VERSION
from swarm.net.tls import NODE_SERVER_NAME, Security
from swarm.ops.metrics import Metrics
from tests import procs, test_links
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA with the coordinator's certificate and one node's, and a second, unrelated CA."""
    root = tmp_path_factory.mktemp("pki")
    certs.init(root / "swarm")
    certs.issue_node(root / "swarm", "node0")
    for name in ("planned", "intruder"):
        certs.issue_node(root / "swarm", name)
    certs.init(root / "other")
    certs.issue_node(root / "other", "node0")
    return root


def security(directory: Path, name: str | None = None, mutual: bool = False) -> Security:
    cert, key = (directory / f"{name}.pem", directory / f"{name}.key") if name else (None, None)
    return Security.from_files(directory / "ca.pem", cert, key, mutual)


def test_certs_name_hosts_serve_both_ways_and_keep_keys_private(pki: Path):
    folder = pki / "swarm"
    coordinator = x509.load_pem_x509_certificate((folder / "coordinator.pem").read_bytes())
    node = x509.load_pem_x509_certificate((folder / "node0.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    for cert in (coordinator, node):
        cert.verify_directly_issued_by(ca)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}
    names = coordinator.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    node_names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert node_names.get_values_for_type(x509.DNSName) == [NODE_SERVER_NAME, "node0"]  # its own name: pinned
    for key in ("ca.key", "coordinator.key", "node0.key"):
        assert stat.S_IMODE(os.stat(folder / key).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        certs.init(folder)  # an existing CA is never overwritten
    with pytest.raises(FileExistsError):
        certs.issue_node(folder, "node0")
    with pytest.raises(ValueError):
        certs.issue_node(folder, "../escape")


def test_security_files_are_checked(pki: Path, tmp_path: Path):
    folder = pki / "swarm"
    with pytest.raises(ValueError, match="needs its key"):
        Security.from_files(folder / "ca.pem", folder / "node0.pem", None)
    with pytest.raises(ValueError, match="mutual TLS needs"):
        Security.from_files(folder / "ca.pem", mutual=True)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="no PEM certificate"):
        Security.from_files(tmp_path / "junk.pem")


async def _status(address: str, client: Security | None, server_name: str | None = None) -> grpc.StatusCode:
    """The status code of one Status call (OK when it succeeds); ``client`` None: clear text."""
    channel = (client or tls.INSECURE).aio_channel(address, server_name=server_name)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        await stub.Status(coordinator_pb2.StatusRequest(), timeout=3)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await channel.close()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_a_tls_coordinator_opens_only_to_the_swarms_ca(pki: Path, tmp_path: Path, mutual: bool):
    swarm, other = pki / "swarm", pki / "other"

    async def scenario() -> dict[str, grpc.StatusCode]:
        service = CoordinatorService(
            tiny_config(),
            "tls-test-join-token",
            tmp_path / "state.sqlite",
            None,
            Metrics("coordinator"),
            [],
            security=security(swarm, "coordinator", mutual),
        )
        async with CoordinatorServer(service) as server:
            address = f"127.0.0.1:{server.port}"
            return {
                "member": await _status(address, security(swarm, "node0")),
                "ca only": await _status(address, security(swarm)),
                "clear text": await _status(address, None),
                "other CA": await _status(address, security(other, "node0")),
                "wrong name": await _status(address, security(swarm, "node0"), server_name="example.org"),
            }

    codes = asyncio.run(asyncio.wait_for(scenario(), 30))
    unavailable = grpc.StatusCode.UNAVAILABLE
    expected = {
        "member": grpc.StatusCode.OK,
        "ca only": unavailable if mutual else grpc.StatusCode.OK,  # no client certificate
        "clear text": unavailable,
        "other CA": unavailable,
        "wrong name": unavailable,
    }
    assert codes == expected


class PinnedAcceptor(test_links.Acceptor):
    """The accepting side of boundary 0 whose plan pins the dialling node's certificate."""

    def peers_of(self, boundary: int) -> list[PlannedPeer]:
        return [replace(test_links.UP_PEER, certificate="planned")] if boundary == 0 else []


def test_streams_are_pinned_to_the_certificates_the_plan_names(pki: Path):
    """Under mutual TLS the plan names each peer's certificate: a node of the same CA holding the
    boundary's secret but another certificate is refused, and a dialler reaches only the server
    whose certificate the plan names."""
    swarm = pki / "swarm"

    async def attach(boundary: int, link) -> None:
        await asyncio.sleep(0.2)

    async def dial_as(address: str, name: str, server_certificate: str) -> str:
        peer = replace(test_links.DOWN_PEER, certificate=server_certificate)
        client = security(swarm, name, mutual=True)
        try:
            _, channel = await dial(
                address, test_links.CLIENT, 0, 0, peer, Metrics("node"), timeout=2, security=client
            )
        except LinkError as e:
            return str(e)
        await channel.close()
        return "accepted"

    async def main() -> list[str]:
        service = StageService(Metrics("node"))
        service.acceptor = PinnedAcceptor(attach)
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServicer_to_server(service, server)
        port = security(swarm, "node0", mutual=True).add_port(server, "127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        await server.start()
        try:
            cases = [("planned", "node0"), ("intruder", "node0"), ("planned", "planned")]
            return [await dial_as(address, client, server) for client, server in cases]
        finally:
            await server.stop(None)

    planned, intruder, wrong_server = asyncio.run(asyncio.wait_for(main(), 60))
    assert planned == "accepted"
    assert "ERROR_CODE_UNAUTHENTICATED" in intruder
    assert "client certificate intruder, the plan names planned" in intruder
    assert "could not reach" in wrong_server  # the server's certificate is node0's, not "planned"


def test_certificate_pins_survive_a_coordinator_restart(pki: Path, tmp_path: Path):
    """A mutual-TLS coordinator records the certificate each node joined with; a restarted one on
    the same state still pins each boundary to the peer's certificate."""
    swarm = pki / "swarm"
    token = "tls-test-join-token"

    async def life(names: list[str]) -> dict[str, coordinator_pb2.JoinReply | coordinator_pb2.HeartbeatReply]:
        service = CoordinatorService(
            tiny_config(n_stages=2),
            token,
            tmp_path / "state.sqlite",
            None,
            Metrics("coordinator"),
            [],
            CoordinatorSettings(reach_timeout_s=0.0),  # the made-up address below is taken on trust
            security=security(swarm, "coordinator", mutual=True),
        )
        replies = {}
        async with CoordinatorServer(service) as server:
            for name in names:
                channel = security(swarm, name, mutual=True).aio_channel(f"127.0.0.1:{server.port}")
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                if name in joined:
                    node = joined[name]
                    metadata = session_metadata(node.node_id, node.session)
                    request = coordinator_pb2.HeartbeatRequest(node_id=node.node_id)
                    replies[name] = await stub.Heartbeat(request, timeout=5, metadata=metadata)
                else:
                    join = coordinator_pb2.JoinRequest(
                        protocol_version=PROTOCOL_VERSION, token=token, announce_address="127.0.0.1:1"
                    )
                    replies[name] = joined[name] = await stub.Join(join, timeout=5)
                await channel.close()
        return replies

    joined: dict[str, coordinator_pb2.JoinReply] = {}
    asyncio.run(asyncio.wait_for(life(["planned", "node0"]), 30))
    after = asyncio.run(asyncio.wait_for(life(["node0"]), 30))  # a new coordinator process, same state
    (link,) = after["node0"].plan.links
    assert link.peer_node_id == joined["planned"].node_id and link.peer_certificate == "planned"


def _args(**flags) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tls.add_arguments(parser)
    argv = []
    for name, value in flags.items():
        option = "--" + name.replace("_", "-")
        argv += [option] if value is True else [option, str(value)]
    return parser.parse_args(argv)


def refusal(args: argparse.Namespace, addresses: list[str], capsys, server: bool = True) -> str:
    """What ``tls.from_args`` tells the user before exiting with status 2."""
    with pytest.raises(SystemExit) as exit_:
        tls.from_args(args, "t", addresses, server)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_clear_text_needs_loopback_or_an_explicit_insecure(pki: Path, caplog, capsys):
    assert tls.from_args(_args(), "t", ["127.0.0.1:5000", "[::1]:1", "localhost:2", ""]) is tls.INSECURE
    assert "0.0.0.0:5000 is not loopback" in refusal(_args(), ["0.0.0.0:5000"], capsys)
    assert "10.0.0.1:7000 is not loopback" in refusal(_args(), ["127.0.0.1:1", "10.0.0.1:7000"], capsys)
    assert tls.from_args(_args(insecure=True), "t", ["0.0.0.0:5000"]) is tls.INSECURE
    assert "clear-text gRPC" in caplog.text
    ca = pki / "swarm/ca.pem"
    assert "needs --tls-cert and --tls-key" in refusal(_args(tls_ca=ca), [], capsys)
    assert "contradict" in refusal(_args(tls_ca=ca, insecure=True), [], capsys)
    assert "need --tls-ca" in refusal(_args(mutual_tls=True), [], capsys)
    assert "cannot use the TLS files" in refusal(_args(tls_ca=pki / "missing.pem"), [], capsys, server=False)
    client = tls.from_args(_args(tls_ca=ca), "t", ["10.0.0.1:1"], server=False)
    assert client.tls and client.cert is None


def test_coordinator_cli_refuses_clear_text_on_a_public_address(tmp_path: Path):
    procs_list: list[procs.Proc] = []
    try:
        args = [sys.executable, "-m", "swarm.coordinator.cli", "serve", "--no-dht", "--metrics-port", "-1"]
        args += ["--host", "0.0.0.0", "--state", str(tmp_path / "s.sqlite")]
        procs_list.append(procs.Proc(args, tmp_path / "c.err"))
        assert procs_list[0].wait(30) == 2
        assert "is not loopback" in procs_list[0].stderr()
    finally:
        for p in procs_list:
            p.stop()


@pytest.mark.timeout(240)
def test_a_mutual_tls_swarm_trains(tmp_path: Path):
    """Coordinator and two nodes on mutual TLS; the run completes; Status needs a certificate."""
    pki = tmp_path / "pki"
    certs.init(pki)
    for name in ("a", "b"):
        certs.issue_node(pki, name)

    with procs.processes() as running:
        address = procs.coordinator(
            running, tmp_path, 6, *tls.cli_flags(pki, "coordinator"), port=procs.free_port()
        )
        nodes = [
            procs.node(running, tmp_path, name, address, *tls.cli_flags(pki, name)) for name in ("a", "b")
        ]
        for n in nodes:
            assert n.wait(180) == 0, n.stderr()
        # the plan pinned the stream to the other node's certificate, and it was dialled under that name
        dialled = re.findall(
            r"dialled stage \d at \S+ \(certificate (\w+)\)", nodes[0].stdout() + nodes[1].stdout()
        )
        assert len(dialled) == 1 and dialled[0] in ("a", "b"), [n.output() for n in nodes]
        client = security(pki, "a")
        with client.channel(address) as channel:
            reply = coordinator_pb2_grpc.CoordinatorStub(channel).Status(
                coordinator_pb2.StatusRequest(), timeout=5
            )
        assert reply.run_complete and len(reply.steps) == 6
        assert asyncio.run(_status(address, security(pki))) == grpc.StatusCode.UNAVAILABLE


def test_swarm_certs_command(tmp_path: Path, capsys):
    from swarm.cli import main

    folder = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(folder), "--host", "coord.example.org"]) == 0
    assert "swarm-coordinator serve --tls-ca" in capsys.readouterr().out
    assert main(["certs", "issue", "--dir", str(folder), "--name", "alice"]) == 0
    assert f"--tls-cert {folder / 'alice.pem'}" in capsys.readouterr().out
    names = x509.load_pem_x509_certificate((folder / "coordinator.pem").read_bytes()).extensions
    assert names.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == ["coord.example.org"]
    assert main(["certs", "init", "--dir", str(folder)]) == 2  # an existing CA is never replaced
    assert "already holds a CA" in capsys.readouterr().err
