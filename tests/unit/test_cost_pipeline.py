"""Pipeline schedules: Narayanan et al.'s bubbles, in-flight micro-batches, and the closed-form
step time against an op-by-op play of the schedule with uneven stages."""
from __future__ import annotations

import random

import pytest

from cost_models.held_activations import covers, held_moments, interleaved_order, least_held
from cost_models.pipeline import bubble_fraction, pipeline_step_time_s, simulate_schedule


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

def test_held_micro_batches_without_interleaving():
    assert [held_moments("1f1b", 4, 8, d) for d in range(4)] == [((4.0,),), ((3.0,),), ((2.0,),), ((1.0,),)]
    assert held_moments("1f1b", 4, 2, 0) == ((2.0,),)  # never more than exist
    assert held_moments("gpipe", 4, 8, 3) == ((8.0,),)  # all m
    assert held_moments("gpipe", 1, 8, 0) == ((1.0,),)  # no pipeline: accumulation frees each


def torch_interleaved_order(p: int, v: int, m: int, device: int) -> list[tuple[str, int]]:
    """("F"/"B", local chunk) of torch's ScheduleInterleaved1F1B on rank `device`: the rank's
    list of its pipeline_order, built by the schedule's own per-rank method (no process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule.rank, schedule._n_microbatches = p, v, device, m
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    order = []
    for action in schedule._calculate_single_rank_operations(device):
        if action is not None:
            kind = str(getattr(action.computation_type, "value", action.computation_type))
            order.append(("F" if kind.startswith("F") else "B", action.stage_index // p))
    return order


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (4, 3), (8, 4)])
def test_interleaved_order_is_torchs(p, v):
    for m in (1, 2, 3, 4, 6, 8, 16, 32):
        if m % max(1, m // p) == 0:  # torch's condition on the rounds
            for device in range(p):
                assert interleaved_order(p, v, m, device) == torch_interleaved_order(p, v, m, device)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (8, 4, 32), (8, 2, 16)])
def test_interleaved_first_rank_holds_korthikantis_count_with_its_first_chunk_heaviest(p, v, m):
    """Korthikanti et al. 2022 §4.2.3: the first rank holds p·(1 + (p-1)/(p·v)) micro-batches'
    worth of its layers, i.e. p·v + p - 1 chunk-micro-batches; the first chunk holds 2p - 1 of
    them at the end of the warm-up, every other chunk p. Later moments trade the last chunk's
    for the first ones', so the per-chunk maxima are not reached at once."""
    moments = held_moments("interleaved_1f1b", p, m, 0, v)
    assert max(sum(moment) for moment in moments) == p * v + p - 1
    assert (2 * p - 1,) + (p,) * (v - 1) in moments
    assert all(covers(moment, other) is False or moment == other for moment in moments for other in moments)
    most = [max(moment[c] for moment in moments) for c in range(v)]
    assert most[0] == 2 * p and sum(most) > p * v + p - 1
    assert least_held(moments) == p


def test_interleaving_holds_earlier_chunks_at_least_as_long_as_later_ones():
    """What the block partition's least-held arrangement rests on (heavier options in later
    chunks): at every moment torch's interleaved schedule can peak, every rank holds each chunk
    at least as many micro-batches as the chunk after it, whatever p, v and m."""
    for p in range(2, 11):
        for v in range(2, 6):
            for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 3 * p + 2}):
                for device in range(p):
                    for moment in held_moments("interleaved_1f1b", p, m, device, v):
                        assert all(moment[c] >= moment[c + 1] for c in range(v - 1)), (p, v, m, device, moment)
