"""`swarm plan` against figures computed by hand."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from swarm.cli import build_parser, main
from swarm.core.config import MODEL_PRESETS, ModelConfig, RunConfig
from swarm.core.plan import DEFAULT_LAW, GapLaw, Link, Measured, plan, recommend, tokens_per_second
from swarm.core.profiles import ComputeProfile, load_profile

# 10 us forward and 20 us backward per token and layer; a boundary's maps 4 us per token (1 us a side)
PROFILE = ComputeProfile("made-up", "test", "none", "by hand", 10.0, 20.0, 512, boundary_us_per_token=4.0)
LAW = GapLaw((0.01, -0.002, 0.0, 0.0), uncertainty=0.01, alpha=0.1, source="by hand")


def model(n_layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=1024, n_layers=n_layers, n_heads=16, d_ff=2048)


def test_two_stages_on_100_mbits_by_hand():
    link = Link(100.0, 40.0)  # 12.5 MB/s
    # dense: 1024 x 2 B x 1000 tokens = 2.048 MB per microbatch = 0.16384 s, more than a stage's
    # compute (2 layers x 1000 tokens: 0.02 s forward, 0.04 s backward); (M + P - 1) = 5 slots, 1 RTT
    dense = 4000 / (5 * (0.16384 + 0.16384) + 0.04)
    # k = 16: 32 kB = 2.56 ms on the wire; compute binds, plus one side of maps (1 ms) per stage
    k16 = 4000 / (5 * (0.021 + 0.041) + 0.04)
    rows = plan(model(4), PROFILE, link, LAW, [16, 4096], n_stages=2, microbatches=4, microbatch_tokens=1000)
    assert [r.rank for r in rows] == [0, 16]  # a rank of d or more is no compression: left out
    assert rows[0].tokens_per_s == pytest.approx(dense) and rows[1].tokens_per_s == pytest.approx(k16)
    gap = 0.01 - 0.002 * math.log(16)
    factor = (1 + gap + 0.01) ** 10  # the pessimistic gap, alpha = 0.1
    assert rows[1].gap == pytest.approx(gap) and rows[1].steps_factor == pytest.approx(factor)
    assert rows[1].speedup == pytest.approx(k16 / dense / factor)
    assert recommend(rows, max_gap=0.01) is rows[1]
    assert recommend(rows, max_gap=0.004) is rows[0]  # a predicted gap of 0.0045 is above 0.4%: dense


def test_uneven_stages_on_a_slow_link_by_hand():
    link = Link(8.0, 100.0)  # 1 MB/s
    # 5 layers in 2 stages: 3 and 2; 500 tokens per microbatch, 2 microbatches
    # dense: 1024 x 2 x 500 = 1.024 s a microbatch on the wire; 3 slots; one RTT of 0.1 s
    dense = 1000 / (3 * (1.024 + 1.024) + 0.1)
    # k = 64: 64 x 2 x 500 = 0.064 s on the wire; the 3-layer stage: 0.015 s + 0.0005 s maps
    # forward, 0.03 + 0.0005 backward: the wire binds both ways
    k64 = 1000 / (3 * (0.064 + 0.064) + 0.1)
    assert tokens_per_second(model(5), PROFILE, link, 2, 2, 500, 0) == pytest.approx(dense)
    assert tokens_per_second(model(5), PROFILE, link, 2, 2, 500, 64) == pytest.approx(k64)
    (row,) = plan(model(5), PROFILE, link, LAW, [64], 2, 2, 500)[1:]
    assert row.steps_factor == pytest.approx((1 + 0.01 - 0.002 * math.log(64) + 0.01) ** 10)


def test_a_negative_gap_counts_as_none():
    law = GapLaw((-0.5, 0.0, 0.0, 0.0), uncertainty=0.01, alpha=0.1, source="by hand")
    (row,) = plan(model(4), PROFILE, Link(100.0, 40.0), law, [16], 2)[1:]
    assert row.gap == -0.5 and row.steps_factor == 1.0


def test_a_measured_point_replaces_the_law_at_its_width_only():
    two_seeds = Measured(1024, 32, "mup-anchored", 0.002, 0.005, (0.02, -0.01))
    one_seed = Measured(1024, 16, "mup", 0.001, -0.02, (-0.02,))
    elsewhere = Measured(512, 8, "mup", 0.001, 0.0, (0.0,))
    law = GapLaw(LAW.coef, 0.01, 0.1, "by hand", (two_seeds, one_seed, elsewhere), 1000, layers=4, vocab=256)
    rows = plan(model(4), PROFILE, Link(100.0, 40.0), law, [16, 64], n_stages=2)
    by_rank = {r.rank: r for r in rows}
    assert sorted(by_rank) == [0, 16, 32, 64]  # the measured rank 32 joins; 512's rank 8 does not
    # two seeds: half their spread (0.015); one seed: twice the seed noise (0.02)
    assert (by_rank[32].gap, by_rank[32].uncertainty, by_rank[32].measured) == (0.005, 0.015, two_seeds)
    assert by_rank[32].steps_factor == pytest.approx((1 + 0.005 + 0.015) ** 10)
    assert (by_rank[16].gap, by_rank[16].uncertainty, by_rank[16].steps_factor) == (-0.02, 0.02, 1.0)
    assert by_rank[64].measured is None and by_rank[64].gap == pytest.approx(0.01 - 0.002 * math.log(64))
    # another horizon, depth or vocabulary than the grid's: the law
    assert plan(model(4), PROFILE, Link(100.0, 40.0), law, [], 2, steps=2000)[1:] == []
    assert plan(model(6), PROFILE, Link(100.0, 40.0), law, [], 2)[1:] == []
    other_vocab = dataclasses.replace(model(4), vocab_size=512)
    assert all(r.measured is None for r in plan(other_vocab, PROFILE, Link(100.0, 40.0), law, [16], 2))


def test_another_optimizer_than_the_laws_takes_only_its_own_measured_points():
    """Gaps are against dense with the same optimizer: a Muon point never stands in for AdamW's, with
    Muon (no law fitted on it) the law's ranks are no candidates, and its steps to dense's loss
    follow Muon dense's loss-vs-steps exponent."""
    adamw = Measured(1024, 16, "mup-anchored", 0.001, -0.01, (-0.01, -0.01))
    muon = Measured(1024, 16, "mup-anchored", 0.004, 0.06, (0.05, 0.07), "muon")
    law = GapLaw(LAW.coef, 0.01, 0.1, "by hand", (adamw, muon), 1000, 4, 256, alphas={"muon": 0.2})
    rows = plan(model(4), PROFILE, Link(100.0, 40.0), law, [32], n_stages=2)
    assert [(r.rank, r.measured) for r in rows] == [(0, None), (16, adamw), (32, None)]
    rows = plan(model(4), PROFILE, Link(100.0, 40.0), law, [32], n_stages=2, optimizer="muon")
    assert [(r.rank, r.measured) for r in rows] == [(0, None), (16, muon)]
    assert rows[1].gap == 0.06 and rows[1].uncertainty == pytest.approx(0.01)
    assert rows[1].steps_factor == pytest.approx(1.07**5)  # Muon dense's own exponent, not the law's 0.1
    assert recommend(rows, 0.03).rank == 0  # +6% is beyond the accepted gap: dense


def test_the_embedded_default_run_is_the_plans_recommendation_for_its_width():
    """`make run` (RunConfig's defaults) trains what `swarm plan --preset small --stages 4` recommends
    with its other defaults (link, profile, ranks, the grid's horizon) from the shipped law: the
    measured rank, parametrisation and lr."""
    default = RunConfig()
    assert default.model == MODEL_PRESETS["small"]
    args = build_parser().parse_args(["plan", "--preset", "small", "--stages", str(default.n_stages)])
    law = GapLaw.load(args.law)
    assert args.steps == law.steps  # the horizon the grid measured
    ranks = [int(k) for k in args.ranks.split(",")]
    link = Link(args.mbps, args.rtt_ms)
    profile = load_profile(args.profile)
    shape = (args.stages, args.microbatches, args.microbatch_tokens, args.steps)
    rows = plan(default.model, profile, link, law, ranks, *shape)
    best = recommend(rows, args.max_gap).measured
    assert best is not None and best.d == default.model.d_model
    assert (default.model.subspace_rank, default.model.parametrisation, default.train.lr) == (
        best.rank,
        best.parametrisation,
        best.lr,
    )


def test_the_command_prints_every_candidate_and_one_recommendation(tmp_path, capsys):
    law = tmp_path / "law.json"  # a scaling bench result holding a law
    law.write_text(json.dumps({"law": {"coef": [0.01, -0.002, 0.0, 0.0], "loo_error": 0.01, "alpha": 0.1}}))
    assert main(["plan", "--ranks", "20,40", "--law", str(law)]) == 0
    out = capsys.readouterr().out
    assert "dense bf16" in out and "subspace k=20" in out and "subspace k=40" in out
    assert out.count("<- recommended") == 1 and "An estimate" in out
    rows = [line for line in out.splitlines() if line.startswith("subspace")]
    assert all(line.split()[7] == "law" for line in rows) and "recommended settings" not in out
    point = {"d": 4096, "rank": 32, "parametrisation": "mup", "lr": 0.001, "gap": -0.05, "seed_gaps": [-0.05]}
    grid = {"measured": [point], "shape": {"n_layers": 8, "vocab_size": 32000}}  # the 2b-8layer preset's
    law.write_text(json.dumps({"law": json.loads(law.read_text())["law"] | grid}))
    assert main(["plan", "--ranks", "40,80", "--law", str(law)]) == 0  # 32: fewest bytes, no gap
    out = capsys.readouterr().out
    assert "subspace k=32 bf16" in out and "-5.0% ± 2.0 measured" in out
    assert "(measured at d=4096, 1 seed(s)): model.subspace_rank = 32, model.parametrisation = 'mup'" in out
    assert "train.optimizer = 'adamw'" in out
    assert main(["plan", "--ranks", "40,80", "--law", str(law), "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out  # no muon point, no muon law: dense alone
    assert "only the ranks the grid measured with it at d=4096 are candidates (0 here" in out
    assert [line.split()[0] for line in out.splitlines()[3:-1]] == ["dense"]
    law.write_text(json.dumps({"law": {"error": "one rank: no law"}}))
    assert main(["plan", "--law", str(law)]) != 0
    assert "no fitted law (one rank: no law)" in capsys.readouterr().err
    assert GapLaw.load(DEFAULT_LAW).alpha > 0  # the shipped law loads
