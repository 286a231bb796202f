"""The `state` benchmark section, small: restores from 1 and 2 holders (paced on loopback, or processes
on emulated hosts behind rate-limited links), and the pause per snapshot."""

from __future__ import annotations

import pytest

from bench import netns, state
from swarm.core.config import MODEL_PRESETS, TrainConfig


# The loopback path (where netns is unavailable) is in the slow suite; the quick bench runs whichever works.
@pytest.mark.parametrize("links", [pytest.param("loopback", marks=pytest.mark.slow), "emulated"])
def test_the_state_section_restores_from_holders_and_measures_the_pause(links):
    if links == "emulated" and not netns.available()[0]:
        pytest.skip(f"no network namespaces: {netns.available()[1]}")
    plan = state.StatePlan(
        MODEL_PRESETS["tiny"],
        TrainConfig(batch_size=4, seq_len=32, microbatches=2),
        n_stages=2,
        steps=3,
        state_bytes=12 << 20,
        holder_mbps=200.0,
        holders=(1, 2),
        emulated=links == "emulated",
    )
    r = state.run(plan)
    one, two = r["restore"]
    assert (one["holders"], two["holders"]) == (1, 2) and one["links"] == two["links"] == links
    assert one["coordinator_bytes"] == two["coordinator_bytes"] == 0
    assert sum(one["served_bytes"]) == sum(two["served_bytes"]) == 12 << 20
    assert min(two["served_bytes"]) >= 4 << 20  # both holders serve it side by side
    # Neither the pacing nor the emulated links let the bytes through faster than their rate.
    assert one["ratio_to_ideal"] >= 0.9 and two["ratio_to_ideal"] >= 0.9
    # A cut a keeper fetches through the whole uplink takes as long as the 1-holder restore; a quarter
    # of it, four times that.
    interval = {row["share"]: row["seconds"] for row in r["cut_interval"]}
    assert interval[1.0] == pytest.approx(one["seconds"]) and interval[0.25] == pytest.approx(
        4 * one["seconds"]
    )
    moments = r["moments"]  # 8-bit moments: about half the bytes, close to (not exactly) the original run
    assert moments["int8"]["bytes"] < 0.6 * moments["exact"]["bytes"]
    assert moments["exact"]["max_loss_deviation"] == 0 < moments["int8"]["max_loss_deviation"] < 1e-2
    pause = r["pause"]
    assert 0 < pause["pause_seconds_per_stage"] < pause["step_seconds"] and pause["copy_seconds"] > 0
    text = "\n".join(state.section(r))
    assert "## Stage state" in text and f"| 2 | {links} | 13 MB | 200 Mbit/s |" in text
