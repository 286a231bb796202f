"""The verification bench's detection arithmetic: the simulated draws agree with the closed form,
and a suspect's raised rate is modelled as the nodes apply it."""

from __future__ import annotations

import math

from bench.verification import caught_within, needed, simulate


def test_the_simulated_draw_agrees_with_the_closed_form():
    for p, f in ((0.02, 1.0), (0.05, 0.1)):
        exact = caught_within(1.0, p, f, 200)
        share = simulate(p, f, 1.0, microbatches=4, steps=50, trials=4000, seed=1)
        assert abs(share - exact) < 4 * math.sqrt(exact * (1 - exact) / 4000) + 1e-9, (p, f, share, exact)


def test_needed_is_the_fewest_microbatches_for_the_confidence():
    n = needed(1.0, 0.02, 1.0, 0.99)
    assert caught_within(1.0, 0.02, 1.0, n) >= 0.99 > caught_within(1.0, 0.02, 1.0, n - 1)


def test_a_suspect_is_caught_once_its_siblings_audit_everything():
    # p tiny, but after the first flag both siblings audit every microbatch: evicted unless the
    # first flag came in the epoch's last steps
    plain = simulate(0.01, 1.0, 1.0, microbatches=4, steps=50, trials=2000, seed=2)
    raised = simulate(0.01, 1.0, 1.0, 4, 50, 2000, suspect_rate=1.0, notice_steps=0, seed=2)
    first_flag = 1 - (1 - 0.01) ** (2 * 4 * 49)  # some flag by step 48, the other sibling's at 49
    assert raised >= first_flag - 0.02 and raised > plain + 0.1
    # a suspect the siblings are never told about is audited at p like any other
    never = simulate(0.01, 1.0, 1.0, 4, 50, 2000, suspect_rate=1.0, notice_steps=10**6, seed=2)
    assert never == plain
