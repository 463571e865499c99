"""Pipeline schedules: Narayanan et al.'s bubbles, in-flight micro-batches, and the closed-form
step time against an op-by-op play of the schedule with uneven stages."""
from __future__ import annotations

import random

import pytest

from cost_models.pipeline import bubble_fraction, in_flight_micro_batches, pipeline_step_time_s, simulate_schedule


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 8, 2), (8, 32, 4), (2, 2, 1)])
def test_uniform_stages_give_the_papers_bubble(p, m, v):
    """Narayanan et al. 2021 §2.2: bubble (p-1)/m for GPipe/1F1B, (p-1)/(v·m) interleaved."""
    d = 2.0  # one micro-batch's forward + backward on one device (all its v chunks)
    step = pipeline_step_time_s([d] * p, m, v)
    assert step == pytest.approx(m * d * (1 + (p - 1) / (v * m)))
    assert (step - m * d) / (m * d) == pytest.approx(bubble_fraction(p, m, v))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_played_schedule_equals_closed_form_on_uniform_stages(schedule):
    for p, m in ((2, 2), (4, 8), (6, 16), (3, 5)):
        assert simulate_schedule([1.0] * p, [2.0] * p, m, schedule) == pytest.approx(pipeline_step_time_s([3.0] * p, m))


@pytest.mark.parametrize("spread,gpipe_low,onef1b_high", [(0.1, 0.97, 1.10), (0.6, 0.94, 1.22)])
def test_closed_form_brackets_the_played_schedule_on_uneven_stages(spread, gpipe_low, onef1b_high):
    """With uneven stages the closed form (m-1)·max D + Σ D is an upper bound on played 1F1B
    (whose steady state hides part of a slow stage's excess) and a lower bound on played GPipe
    (which pays the slowest forward and the slowest backward separately). Forwards within ±10%
    (backwards ±20% more), as balanced partitions give, keep them within 3% (GPipe) and 10%
    (1F1B); stages differing by up to 4x within 6% and 22%. p2p hops (priced into D twice per
    boundary) keep it an upper bound for 1F1B."""
    rng = random.Random(7)
    for _ in range(60):
        p = rng.choice([2, 3, 4, 6, 8])
        m = rng.choice([p, 2 * p, 3 * p + 1])
        forward = [rng.uniform(1 - spread, 1 + spread) for _ in range(p)]
        backward = [2 * f * rng.uniform(0.8, 1.2) for f in forward]
        closed = pipeline_step_time_s([f + b for f, b in zip(forward, backward)], m)
        gpipe = simulate_schedule(forward, backward, m, "gpipe")
        assert gpipe_low * gpipe <= closed <= gpipe * (1 + 1e-9)
        played = simulate_schedule(forward, backward, m, "1f1b")
        assert played <= closed * (1 + 1e-9) and closed <= onef1b_high * played
        hop = 0.05
        with_p2p = [f + b + (2 * hop if s < p - 1 else 0.0) for s, (f, b) in enumerate(zip(forward, backward))]
        assert simulate_schedule(forward, backward, m, "1f1b", hop) <= pipeline_step_time_s(with_p2p, m) * (1 + 1e-9)


def test_in_flight_micro_batches_per_schedule():
    assert [in_flight_micro_batches("1f1b", 4, 8, d) for d in range(4)] == [4, 3, 2, 1]  # p - stage index
    assert in_flight_micro_batches("1f1b", 4, 2, 0) == 2  # never more than exist
    assert in_flight_micro_batches("gpipe", 4, 8, 3) == 8  # all m
    # Korthikanti et al. 2022 §4.2.3: interleaving multiplies the first stage's by 1 + (p-1)/(p·m).
    assert in_flight_micro_batches("interleaved_1f1b", 4, 8, 0, 2) == pytest.approx(4 * (1 + 3 / 32))
    assert in_flight_micro_batches("gpipe", 1, 8, 0) == 1  # no pipeline: accumulation frees each
