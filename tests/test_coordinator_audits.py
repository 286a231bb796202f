"""The coordinator's side of audits between sibling replicas: reports counted and checked, the
eviction of a node distinct auditors found computing wrong, the rollback past everything it
contributed to, its banned join token, and what plans carry for the auditors."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import grpc
from swarm.coordinator.audits import CONTRADICTING_MATCHES, LIAR_MISMATCHES
from swarm.coordinator.ledger import PAST_DEALS

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import AuditConfig, ReplicaSyncConfig, RunConfig
from swarm.ops.status import render
from tests.helpers import tiny_config
from tests.test_coordinator import RPC_TIMEOUT, Harness, NodeCredentials, coordinator, refused, run

# Replicas averaging every step (the default sync mode) with a rate above 0: audits are on.
AUDITED = tiny_config(n_stages=2, microbatches=4, replicas=3)
P2P = "/ip4/127.0.0.1/tcp/{}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@dataclasses.dataclass
class Replica:
    """A joined node that announces 127.0.0.1:``port``, averages at a P2P address on the same
    port, and measured ``capacity`` (tokens/s): what a standby needs to become a replica."""

    id: str
    port: int
    capacity: float

    async def beat(self, h: Harness) -> coordinator_pb2.HeartbeatReply:
        """A heartbeat (following no epoch: the reply carries the plan)."""
        return await h.heartbeat(
            self.id,
            averaging_address=P2P.format(self.port),
            capacity_tokens_per_second=self.capacity,
        )

    async def plan(self, h: Harness) -> coordinator_pb2.Plan:
        return (await self.beat(h)).plan


async def replica(h: Harness, name: str, port: int, capacity: float, **join) -> Replica:
    node = Replica((await h.join(name, address=f"127.0.0.1:{port}", **join)).node_id, port, capacity)
    await node.beat(h)
    return node


async def replicated(h: Harness, extra: int = 1) -> tuple[Replica, Replica, list[Replica]]:
    """a hosts stage 0 (slow), b stage 1 (fast); ``extra`` standbys join stage 0 as replicas of a."""
    a = await replica(h, "a", 7001, 100.0)
    b = await replica(h, "b", 7002, 900.0)
    others = [await replica(h, f"r{i}", 7003 + i, 100.0) for i in range(extra)]
    assert h.service.roster.owners() == [(a.id, *(r.id for r in others)), (b.id,)]
    return a, b, others


def audit_report(
    h: Harness, auditor: Replica, audited: Replica, outcome: str = "mismatch", **fields
) -> coordinator_pb2.AuditReport:
    """``auditor``'s report on the first microbatch of stage 0 dealt to ``audited`` this epoch."""
    report = coordinator_pb2.AuditReport(
        node_id=auditor.id,
        plan_epoch=h.service.ledger.plan_epoch,
        stage=0,
        step=max(0, h.service.progress.timeline),
        audited_node_id=audited.id,
        outcome=outcome,
        direction="forward" if outcome == "mismatch" else "",
        rel_l2=0.25 if outcome == "mismatch" else 1e-7,
        cosine=0.9 if outcome == "mismatch" else 1.0,
    )
    dealt = h.service.ledger.microbatches(0, audited.id)
    report.microbatch = dealt[0] if dealt else 0
    report.MergeFrom(coordinator_pb2.AuditReport(**fields))
    return report


async def audit(h: Harness, auditor: Replica, audited: Replica, outcome: str = "mismatch", **fields) -> None:
    await h.stub.ReportAudit(audit_report(h, auditor, audited, outcome, **fields), timeout=RPC_TIMEOUT)


async def steps(h: Harness, a: Replica, b: Replica, first: int, last: int) -> None:
    """The stages' leads report steps ``first``..``last`` in the current epoch."""
    epoch = h.service.ledger.plan_epoch
    for step in range(first, last + 1):
        await h.step(a.id, 0, step, epoch)
        await h.step(b.id, 1, step, epoch)


async def cut(h: Harness, a: Replica, b: Replica, step: int) -> list[coordinator_pb2.StageCheckpoint]:
    epoch = h.service.ledger.plan_epoch
    return [(await h.checkpoint(n.id, epoch, stage, step))[1] for stage, n in enumerate((a, b))]


def alive(h: Harness, node: Replica) -> bool:
    return h.service.roster.alive_node(node.id) is not None


def test_one_auditor_never_evicts_and_every_outcome_is_counted_and_shown(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", AUDITED) as h:
            a, _, (x, z) = await replicated(h, extra=2)
            epoch = h.service.ledger.plan_epoch
            for mb in h.service.ledger.microbatches(0, z.id):  # every microbatch z computed, found wrong
                await audit(h, a, z, microbatch=mb)
            await audit(h, a, z)  # and again: still one auditor
            await audit(h, a, x, "match")
            await audit(h, x, a, "match")
            await audit(h, z, x, "unavailable", detail="evidence gone")
            mismatches = len(h.service.ledger.microbatches(0, z.id)) + 1
            assert alive(h, z) and h.service.ledger.plan_epoch == epoch
            assert h.service.audits.accusers == {z.id: {a.id}}
            status = await h.status()
            assert (status.audits_matched, status.audits_mismatched, status.audits_unavailable) == (
                2,
                mismatches,
                1,
            )
            assert len(status.audit_lines) == mismatches
            assert status.audit_lines[-1].endswith("1 of 2 auditors")
            assert f"node {a.id[:8]} found node {z.id[:8]} computing wrong (forward" in status.audit_lines[0]
            assert h.sample("swarm_audits_total", {"outcome": "mismatch"}) == mismatches
            assert h.sample("swarm_audits_total", {"outcome": "match"}) == 2
            assert not h.sample("swarm_evictions_total", {"reason": "audit"})
            table = render(status, "here")
            assert f"  audits: 2 matched, {mismatches} mismatched, 1 unavailable" in table
            assert f"  audit: {status.audit_lines[-1]}" in table.splitlines()

    run(scenario())


def test_reports_no_auditor_could_have_made_are_refused(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", AUDITED) as h:
            a, b, (x, z) = await replicated(h, extra=2)
            x_mb = h.service.ledger.microbatches(0, x.id)[0]  # dealt to x, not to z
            epoch = h.service.ledger.plan_epoch
            for report, code, label in [
                (audit_report(h, a, a), grpc.StatusCode.INVALID_ARGUMENT, "bad_audit"),  # itself
                (audit_report(h, a, b), grpc.StatusCode.INVALID_ARGUMENT, "bad_audit"),  # not stage 0's
                (audit_report(h, a, z, microbatch=x_mb), grpc.StatusCode.INVALID_ARGUMENT, "bad_audit"),
                (audit_report(h, b, z), grpc.StatusCode.ABORTED, "not_hosting"),  # b audits nobody here
                (audit_report(h, a, z, outcome="maybe"), grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
                (audit_report(h, a, z, plan_epoch=epoch + 1), grpc.StatusCode.ABORTED, "stale_epoch"),
            ]:
                before = h.rejected(label)
                assert await refused(h.stub.ReportAudit(report, timeout=RPC_TIMEOUT)) == code
                assert h.rejected(label) == before + 1, label
            status = await h.status()
            assert (status.audits_matched, status.audits_mismatched, status.audits_unavailable) == (0, 0, 0)
            assert not status.audit_lines and not h.service.audits.accusers

    run(scenario())


def test_a_report_made_in_an_ended_epoch_counts_while_that_epochs_deal_is_kept(tmp_path):
    """An audit finishes after its step, maybe after its epoch: its report is checked against the
    deal of the epoch it was made in, for the last PAST_DEALS epochs; older ones are refused."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", AUDITED) as h:
            a, b, (x, z) = await replicated(h, extra=2)
            made = audit_report(h, a, z)  # in this epoch, on a microbatch dealt to z in it
            h.service.planner.new_epoch("a boundary broke")
            await h.stub.ReportAudit(made, timeout=RPC_TIMEOUT)
            assert h.service.audits.accusers == {z.id: {a.id}}
            # the epoch's hosts are checked as they were: b did not host stage 0 then
            elsewhere = coordinator_pb2.AuditReport()
            elsewhere.CopyFrom(made)
            elsewhere.node_id = b.id
            assert (
                await refused(h.stub.ReportAudit(elsewhere, timeout=RPC_TIMEOUT)) == grpc.StatusCode.ABORTED
            )
            assert h.rejected("not_hosting") == 1
            for _ in range(PAST_DEALS):
                h.service.planner.new_epoch("a boundary broke")
            late = coordinator_pb2.AuditReport()
            late.CopyFrom(made)
            late.node_id = x.id
            assert await refused(h.stub.ReportAudit(late, timeout=RPC_TIMEOUT)) == grpc.StatusCode.ABORTED
            assert h.rejected("stale_epoch") == 1 and h.service.audits.accusers == {z.id: {a.id}}

    run(scenario())


def test_two_auditors_evict_a_node_that_hosted_from_the_start_and_the_run_starts_over(tmp_path):
    """The accused computed from step 0: every cut may hold its values, so none is kept."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", AUDITED) as h:
            a, b, (x, z) = await replicated(h, extra=2)
            assert h.service.planner.first_hosted[z.id] == 0
            await steps(h, a, b, 0, 2)
            await cut(h, a, b, 1)
            assert (await h.status()).latest_cut == 2
            await audit(h, a, z)
            assert alive(h, z)
            await audit(h, x, z)
            assert not alive(h, z)
            status = await h.status()
            assert (status.resume_step, status.latest_cut, status.epochs_restarted) == (0, 0, 1)
            assert not h.service.ledger.checkpoints
            assert status.audit_lines[-1].startswith(f"node {z.id[:8]} (r1) evicted: 2 distinct auditors")
            assert h.sample("swarm_evictions_total", {"reason": "audit"}) == 1
            # z is out of the run: its own reports are refused
            assert await refused(h.stub.ReportAudit(audit_report(h, z, x), timeout=RPC_TIMEOUT)) == (
                grpc.StatusCode.PERMISSION_DENIED
            )
            assert h.service.roster.owners() == [(a.id, x.id), (b.id,)]

    run(scenario())


def test_two_auditors_evict_a_late_replica_and_the_run_resumes_from_the_cut_before_it_joined(tmp_path):
    """z joins stage 0 at the cut after step 3 (its first step: 4); a cut after step 5 follows. Two
    auditors find z wrong: the run resumes after step 3, not from cut 5 (z's values are in it) nor
    from the hosts' own states (as when a replica merely dies); cut 5 is forgotten; z's own join
    token may not join again."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", AUDITED) as h:
            a, b, (x,) = await replicated(h)
            await steps(h, a, b, 0, 3)
            await cut(h, a, b, 1)
            z_token, _ = h.service.gate.tokens.create("z")
            z = await replica(h, "z", 7009, 100.0, token=z_token)
            assert h.service.roster.nodes[z.id].stages == []  # a replica joins at the next cut
            await cut(h, a, b, 3)
            assert h.service.roster.owners() == [(a.id, x.id, z.id), (b.id,)]
            first = h.service.planner.first_hosted
            assert (first[a.id], first[x.id], first[z.id]) == (0, 0, 4)
            await steps(h, a, b, 4, 6)
            later = await cut(h, a, b, 5)
            epoch, restarts = h.service.ledger.plan_epoch, (await h.status()).epochs_restarted
            assert (await h.status()).latest_cut == 6

            await audit(h, a, z)
            await audit(h, a, z)
            assert alive(h, z) and h.service.ledger.plan_epoch == epoch  # one auditor, twice
            await audit(h, x, z)
            assert not alive(h, z)
            status = await h.status()
            assert status.plan_epoch == epoch + 1 and status.epochs_restarted == restarts + 1
            assert (status.resume_step, status.latest_cut) == (4, 4)
            assert not h.service.ledger.from_own_states
            assert sorted({step for step, _ in h.service.ledger.checkpoints}) == [1, 3]
            for record in later:  # the cut built on z's values is gone with its artifacts
                assert await refused(h.fetch(record.digest)) == grpc.StatusCode.NOT_FOUND
            plan = await a.plan(h)
            assert plan.resume_step == 4 and [(r.stage, r.step) for r in plan.restore] == [(0, 3)]
            assert [r.node_id for r in plan.replicas[0].replicas] == [a.id, x.id]
            # z's token is banned (with the reason); the operator's shared token still joins
            code = await refused(h.join("z again", address="127.0.0.1:7010", token=z_token))
            assert code == grpc.StatusCode.PERMISSION_DENIED and h.rejected("banned") == 1
            assert "distinct auditors" in (
                h.service.gate.tokens.banned(h.service.roster.party_of(z.id)) or ""
            )
            await h.join("newcomer", address="127.0.0.1:7011")

    run(scenario())


def test_the_first_hosted_step_only_ever_lowers_and_survives_a_restart(tmp_path):
    """z first hosts at step 4; the run then rolls back to the cut after step 1 with z hosting: its
    values are in the history from step 2 on. a, hosting since step 0, stays at 0."""
    state = tmp_path / "state.sqlite"

    async def first_life() -> tuple[dict[str, int], NodeCredentials]:
        async with coordinator(state, AUDITED) as h:
            a, b, (x,) = await replicated(h)
            await steps(h, a, b, 0, 3)
            await cut(h, a, b, 1)
            z = await replica(h, "z", 7009, 100.0)
            await cut(h, a, b, 3)
            assert h.service.planner.first_hosted[z.id] == 4
            h.service.planner.new_epoch("a test", before_step=2)
            assert h.service.ledger.resume_step == 2
            first = h.service.planner.first_hosted
            assert (first[a.id], first[x.id], first[z.id]) == (0, 0, 2)
            return dict(first), h.credentials

    first, credentials = run(first_life())

    async def second_life() -> None:
        async with coordinator(state, AUDITED, credentials=credentials) as h:
            assert h.service.planner.first_hosted == first

    run(second_life())


def test_plans_carry_an_evidence_secret_when_audits_are_on_and_every_replica_address(tmp_path):
    def expected(h: Harness, epoch: int) -> str:
        message = f"{h.service.run_id}/{epoch}/evidence".encode()
        return hmac.new(h.service.ledger.link_key, message, hashlib.sha256).hexdigest()

    async def on() -> None:
        async with coordinator(tmp_path / "on.sqlite", AUDITED) as h:
            a = await replica(h, "a", 7001, 100.0)
            b = Replica((await h.join("b", address="127.0.0.1:7002")).node_id, 0, 900.0)
            # as a failed dial-back leaves it (the harness takes addresses on trust): b only dials
            h.service.roster.nodes[b.id].reachable = False
            await h.heartbeat(b.id, capacity_tokens_per_second=900.0)
            x = await replica(h, "x", 7003, 100.0)
            plans = [await n.plan(h) for n in (a, x)] + [(await h.heartbeat(b.id)).plan]
            epoch = h.service.ledger.plan_epoch
            assert {p.epoch for p in plans} == {epoch}
            assert {p.evidence_secret for p in plans} == {expected(h, epoch)}
            stages = {s.stage: [(r.node_id, r.address) for r in s.replicas] for s in plans[0].replicas}
            assert stages == {0: [(a.id, "127.0.0.1:7001"), (x.id, "127.0.0.1:7003")], 1: [(b.id, "")]}
            h.service.planner.new_epoch("a test")
            assert (await a.plan(h)).evidence_secret == expected(h, epoch + 1) != expected(h, epoch)

    async def off(name: str, config: RunConfig, replicas: int) -> None:
        async with coordinator(tmp_path / f"{name}.sqlite", config) as h:
            a, _, others = await replicated(h, extra=replicas - 1)
            plan = await a.plan(h)
            assert plan.evidence_secret == "", name
            if others:  # a sibling to report about, but this run has no audits
                report = audit_report(h, a, others[0])
                assert await refused(h.stub.ReportAudit(report, timeout=RPC_TIMEOUT)) == (
                    grpc.StatusCode.INVALID_ARGUMENT
                )
                assert h.rejected("bad_audit") == 1

    run(on())
    outer = dataclasses.replace(AUDITED, replica_sync=ReplicaSyncConfig(mode="outer"))
    never = dataclasses.replace(AUDITED, audit=AuditConfig(rate=0.0))
    for name, config, replicas in [
        ("single", tiny_config(n_stages=2), 1),
        ("outer", outer, 2),
        ("rate0", never, 2),
    ]:
        assert not config.audits
        run(off(name, config, replicas))


def test_an_auditor_whose_accusations_another_party_contradicts_is_evicted_not_the_accused(tmp_path):
    """x reports every audit of z as a mismatch; the accused z becomes a suspect, and once y's audits
    of z come back clean CONTRADICTING_MATCHES times, x (the liar) is evicted, without a rollback."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", AUDITED) as h:
            a, b, (x, z) = await replicated(h, extra=2)
            await steps(h, a, b, 0, 3)
            restarts = h.service.ledger.restarts
            for _ in range(LIAR_MISMATCHES):
                await audit(h, x, z)
            assert (await z.beat(h)).audit_suspects == [z.id]  # audited more from now on
            for i in range(CONTRADICTING_MATCHES):
                assert alive(h, x), i
                await audit(h, a, z, "match")
            assert not alive(h, x) and alive(h, z)
            assert h.sample("swarm_evictions_total", {"reason": "audit_accuser"}) == 1
            assert not h.sample("swarm_evictions_total", {"reason": "audit"})
            assert h.service.ledger.restarts == restarts  # no rollback: its reports changed no weights
            lines = (await h.status()).audit_lines
            assert any(f"node {x.id[:8]}" in line and "contradicted" in line for line in lines)

    run(scenario())
