"""Layer-wise partition ILP: equal to brute force on random small instances, balanced on
uneven models, memory limits respected."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autopar.solver.stage_partition import StagePartitioner
from tests.brute_force import brute_force_partition
from cost_models.held_activations import held_moments
from cost_models.pipeline import PartitionProblem
from cost_models.pipeline import pipeline_step_time_s

GiB = 2**30


def schedule_moments(devices: int, chunks: int, micro_batches: int) -> list:
    """What each device holds as its schedule plays: 1F1B's p - d, or interleaved 1F1B's counts
    per chunk, which differ from chunk to chunk and moment to moment."""
    schedule = "interleaved_1f1b" if chunks > 1 else "1f1b"
    return [held_moments(schedule, devices, micro_batches, d, chunks) for d in range(devices)]


def random_problem(rng: random.Random, layers: int, devices: int, chunks: int, options: int) -> PartitionProblem:
    time = [[rng.uniform(0.5, 2.0) * (1 + 0.3 * r) for r in range(options)] for _ in range(layers)]
    activation = [[int(rng.uniform(0.5, 3.0) * GiB / (1 + r)) for r in range(options)] for _ in range(layers)]
    static = [int(rng.uniform(0.5, 4.0) * GiB) for _ in range(layers)]
    total = sum(static) + sum(max(a) for a in activation)
    m = rng.choice([2, 4, 8])
    return PartitionProblem(
        time_s=time, activation_bytes=activation, static_bytes=static,
        send_s=[rng.uniform(0.0, 0.2) for _ in range(layers)], devices=devices, chunks=chunks,
        micro_batches=m, in_flight=schedule_moments(devices, chunks, m),
        capacity_bytes=[int(total * rng.uniform(0.4, 1.0))] * devices, overhead_bytes=[GiB // 2] * devices,
        speed=[rng.choice([1.0, 1.0, 1.7]) for _ in range(devices)],
        option_names=("none", "selective", "full")[:options],
        per_step_s=[rng.uniform(0.0, 1.0) for _ in range(layers)] if rng.random() < 0.5 else [])


def with_optimizer_step(problem: PartitionProblem, rng: random.Random) -> PartitionProblem:
    """The problem with an optimizer-step moment priced: per layer up to 8 GiB more than its static
    bytes (ZeRO-1's gathered vector), or less (its compute copy freed), at times the tighter limit."""
    return replace(problem, step_bytes=[int(rng.uniform(-0.3, 8.0) * GiB) for _ in range(problem.num_layers)],
                   step_overhead_bytes=[GiB // 4] * problem.devices)


@pytest.mark.parametrize("seed", range(24))
def test_ilp_equals_brute_force(seed):
    rng = random.Random(seed)
    devices = rng.choice([2, 3])
    chunks = rng.choice([1, 1, 2]) if devices == 2 else 1
    problem = random_problem(rng, layers=rng.randint(devices * chunks, 6), devices=devices, chunks=chunks,
                             options=rng.choice([1, 2]))
    if seed % 2:
        problem = with_optimizer_step(problem, rng)
    expected = brute_force_partition(problem)
    found = StagePartitioner().solve(problem)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.status == "OPTIMAL"
        assert found.step_time_s == expected.step_time_s


def test_uneven_model_is_balanced_within_one_layer():
    """A heavy head layer gets a stage nearly to itself; the slowest stage is no more than
    one layer's time above the best possible (total / stages) bound."""
    times = [1.0] * 12 + [4.0]
    problem = PartitionProblem(time_s=[[t] for t in times], activation_bytes=[[0]] * 13, static_bytes=[0] * 13,
                               send_s=[0.0] * 13, devices=4, chunks=1, micro_batches=16,
                               in_flight=[4, 3, 2, 1], capacity_bytes=[GiB] * 4, overhead_bytes=[0] * 4)
    partition = StagePartitioner().solve(problem)
    assert max(partition.device_time_s) <= sum(times) / 4 + max(times)
    assert partition.stages(13)[-1] == [12]
    assert max(partition.device_time_s) == 4.0


def test_memory_limit_forces_recompute_and_is_respected():
    """Without room for stored activations the solver picks the recompute option."""
    problem = PartitionProblem(time_s=[[1.0, 1.3]] * 4, activation_bytes=[[2 * GiB, GiB // 8]] * 4,
                               static_bytes=[GiB] * 4, send_s=[0.0] * 4, devices=2, chunks=1, micro_batches=4,
                               in_flight=[2.0, 1.0], capacity_bytes=[4 * GiB] * 2, overhead_bytes=[0, 0])
    partition = StagePartitioner().solve(problem)
    assert partition is not None
    assert all(used <= 4 * GiB for used in partition.device_memory_bytes)
    assert 1 in partition.options[:2]  # the first stage holds 2 micro-batches: it must recompute


def test_nothing_fits_returns_none():
    problem = PartitionProblem(time_s=[[1.0]] * 2, activation_bytes=[[0]] * 2, static_bytes=[8 * GiB] * 2,
                               send_s=[0.0] * 2, devices=2, chunks=1, micro_batches=2, in_flight=[2, 1],
                               capacity_bytes=[4 * GiB] * 2, overhead_bytes=[0, 0])
    assert StagePartitioner().solve(problem) is None


def test_step_time_formula_matches_bubble_fraction():
    """Equal stages: (m + (p-1)/v)·D, i.e. bubble fraction (p-1)/(v·m) (Narayanan et al. 2021)."""
    p, m, v, device_time = 4, 8, 2, 3.0
    step = pipeline_step_time_s([device_time] * p, m, v)
    assert step == pytest.approx((m + (p - 1) / v) * device_time)
    assert (step - m * device_time) / (m * device_time) == pytest.approx((p - 1) / (v * m))


def block_problem(rng: random.Random, blocks: int, devices: int, chunks: int, options: int) -> PartitionProblem:
    """Prefix (embedding), identical blocks, suffix (norm + head) as in a transformer."""
    block_time = [rng.uniform(0.5, 1.5) * (1 + 0.3 * r) for r in range(options)]
    block_act = [int(rng.uniform(0.5, 2.0) * GiB / (1 + 2 * r)) for r in range(options)]
    layers = 1 + blocks + 2
    time = [[0.2 * (1 + 0.1 * r) for r in range(options)]] + [block_time] * blocks + \
        [[0.1] * options, [rng.uniform(1, 3) * (1 + 0.1 * r) for r in range(options)]]
    activation = [[GiB // 4] * options] + [block_act] * blocks + \
        [[GiB // 8] * options, [2 * GiB // (1 + r) for r in range(options)]]
    static = [2 * GiB] + [GiB] * blocks + [0, 2 * GiB]
    total = sum(static) + sum(max(a) for a in activation)
    m = rng.choice([4, 8])
    return PartitionProblem(
        time_s=time, activation_bytes=activation, static_bytes=static,
        send_s=[0.05] + [0.02] * blocks + [0.02, 0.0], devices=devices, chunks=chunks,
        micro_batches=m, in_flight=schedule_moments(devices, chunks, m),
        capacity_bytes=[int(total * rng.uniform(0.5, 1.0))] * devices, overhead_bytes=[GiB // 4] * devices,
        speed=[rng.choice([1.0, 1.5]) for _ in range(devices)],
        per_step_s=[0.01] * layers if rng.random() < 0.5 else [])


@pytest.mark.parametrize("seed", range(30))
def test_compressed_block_partition_equals_brute_force(seed):
    from autopar.solver.block_partition import BlockPartitioner, find_block_run

    rng = random.Random(100 + seed)
    devices = rng.choice([2, 3])
    chunks = 2 if devices == 2 and rng.random() < 0.5 else 1
    problem = block_problem(rng, blocks=rng.randint(3, 6), devices=devices, chunks=chunks,
                            options=rng.choice([1, 2]))
    if seed % 2:  # the same step bytes for every block, so that they stay one run
        step = [int(rng.uniform(-0.3, 6.0) * GiB) for _ in range(3)]
        problem = replace(problem, step_bytes=[step[0]] + [step[1]] * (problem.num_layers - 3) + [0, step[2]],
                          step_overhead_bytes=[GiB // 4] * problem.devices)
    run = find_block_run(problem)
    assert run is not None and run.first == 1
    allowed = set(range(run.first, run.first + run.count + 1))
    expected = brute_force_partition(problem, allowed_starts=allowed, even_chunks=run)
    found = BlockPartitioner().solve(problem, run)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.step_time_s == expected.step_time_s


def test_compressed_partition_solves_96_blocks_on_64_stages_to_optimality():
    """GPT-3 175B's 96 blocks on 32 pipeline ranks × 2 chunks (planner benchmarks time it)."""
    from autopar.solver.block_partition import BlockPartitioner, find_block_run

    rng = random.Random(7)
    problem = block_problem(rng, blocks=96, devices=32, chunks=2, options=3)
    problem = PartitionProblem(**{**problem.__dict__, "capacity_bytes": [80 * GiB] * 32})
    found = BlockPartitioner().solve(problem, find_block_run(problem))
    assert found is not None and found.status == "OPTIMAL"
    assert sorted(len(stage) for stage in found.stages(problem.num_layers))[-1] <= 4


@pytest.mark.unit
def test_unpinned_stages_split_the_blocks_evenly():
    """A pinned layout with no stage list is split as Megatron-LM splits a model by hand: 128
    blocks over 64 stages is 2 blocks each, the embeddings joining the first stage and the final
    norm and head the last (a split of all 132 layers by count gave the embeddings a stage of
    their own and 3 blocks to two stages)."""
    from cost_models.structure import even_stage_starts

    kinds = ["wte", "wpe"] + ["blocks.0"] * 128 + ["ln_f", "lm_head"]
    starts = even_stage_starts(kinds, 64)
    sizes = [b - a for a, b in zip(starts, starts[1:] + [len(kinds)])]
    assert starts[:2] == [0, 4] and sizes[0] == 4 and sizes[-1] == 4 and set(sizes[1:-1]) == {2}
    # 10 blocks over 4 stages: 2, 3, 3, 2 blocks (positions rounded half to even), the ends joined
    assert even_stage_starts(["e"] + ["b"] * 10 + ["h"], 4) == [0, 3, 6, 9]
    # fewer blocks than stages, or blocks interrupted: an even split of every layer
    assert even_stage_starts(["e", "b", "b", "h"], 4) == [0, 1, 2, 3]
    assert even_stage_starts(["b", "x", "b", "b", "y", "b"], 2) == [0, 3]


def test_tiny_per_step_times_rounded_one_by_one_stay_feasible():
    """Per-step times of microseconds, each rounded to the nearest unit by its constraint, sum to
    more units than their rounded sum (58 against 57 here: DeepSeek-V3's toy under tp2, once
    refused as "nothing fits in memory" with gigabytes to spare). The problem is solvable."""
    per_step = [5.7344e-06, 1.85472e-05, 2.96576e-05, 8.96e-08, 2.8672e-06]
    problem = PartitionProblem(time_s=[[1e-3]] * 5, activation_bytes=[[0]] * 5, static_bytes=[0] * 5,
                               send_s=[0.0] * 5, devices=1, chunks=1, micro_batches=8, in_flight=[1.0],
                               capacity_bytes=[GiB], overhead_bytes=[0], per_step_s=per_step)
    found = StagePartitioner().solve(problem)
    expected = brute_force_partition(problem)
    assert found is not None and found.status == "OPTIMAL"
    assert found.step_time_s == expected.step_time_s


def test_the_optimizer_step_can_be_the_tighter_limit():
    """Two devices, four equal layers: in backward any split fits, but at the optimizer step a
    device holding three layers' transients (3 GiB each) does not; the ILP, the block solver and
    the evaluation all split two and two, and report the step's bytes as the device's memory."""
    from autopar.solver.block_partition import BlockPartitioner, find_block_run
    from cost_models.pipeline import evaluate

    problem = PartitionProblem(time_s=[[1.0], [1.0], [1.0], [2.5]], activation_bytes=[[GiB]] * 4,
                               static_bytes=[GiB] * 4, send_s=[0.0] * 4, devices=2, chunks=1, micro_batches=4,
                               in_flight=[1.0, 1.0], capacity_bytes=[10 * GiB] * 2, overhead_bytes=[0, 0])
    assert StagePartitioner().solve(problem).stage_starts == [0, 3]  # the slow last layer alone
    stepped = replace(problem, step_bytes=[3 * GiB] * 4, step_overhead_bytes=[0, 0])
    assert evaluate(stepped, [0, 3], [0] * 4) is None  # 3 x (1 + 3) GiB = 12 GiB at the step
    found = StagePartitioner().solve(stepped)
    assert found.stage_starts == [0, 2] and found.device_memory_bytes == [8 * GiB, 8 * GiB]
    run = find_block_run(stepped)
    assert BlockPartitioner().solve(stepped, run).stage_starts == [0, 2]


def test_interleaving_keeps_the_blocks_it_does_not_recompute_where_they_are_held_least():
    """Rank 0 of p = 2, v = 2, m = 8 holds its first chunk's activations for 3-4 micro-batches and
    its second's for 1-2: with room for some blocks without recomputation, the partition puts
    them in the second chunk, keeps each device's chunks even, and every moment under capacity."""
    from autopar.solver.block_partition import BlockPartitioner, find_block_run

    blocks, m = 8, 8
    moments = [held_moments("interleaved_1f1b", 2, m, d, 2) for d in range(2)]
    assert moments[0] == ((3.0, 2.0), (4.0, 1.0))
    problem = PartitionProblem(  # blocks, then a head (no prefix: stage 0 holds blocks)
        time_s=[[1.0, 1.3]] * blocks + [[0.01, 0.01]],
        activation_bytes=[[GiB, GiB // 16]] * blocks + [[GiB // 64] * 2],
        static_bytes=[GiB // 8] * (blocks + 1), send_s=[0.0] * (blocks + 1), devices=2, chunks=2,
        micro_batches=m, in_flight=moments, capacity_bytes=[9 * GiB] * 2, overhead_bytes=[0, 0],
        option_names=("none", "full"))
    run = find_block_run(problem)
    found = BlockPartitioner().solve(problem, run)
    assert found is not None and found.status == "OPTIMAL"
    stages = found.stages(problem.num_layers)
    kept = [sum(1 for layer in stages[j] if layer < blocks and found.options[layer] == 0) for j in range(4)]
    assert kept[0] < kept[2]  # device 0: fewer kept in its first chunk (held 3-4x) than its second
    counts = [sum(1 for layer in stages[j] if layer < blocks) for j in range(4)]
    assert abs(counts[0] - counts[2]) <= 1
    assert found.step_time_s == brute_force_partition(problem, set(range(1, blocks + 1)), run).step_time_s


@pytest.mark.parametrize("seed", range(12))
def test_block_partition_equals_brute_force_on_every_chunk_layout(seed):
    """Interleaving on one device (its first chunk holds the prefix, its last the suffix), on two
    or three devices with two or three chunks, three recompute options: the per-device tables
    (each count of blocks at its least time, chunks held unevenly) and the program over them
    find the brute-force optimum over every even-chunked partition and option."""
    from autopar.solver.block_partition import BlockPartitioner, find_block_run

    rng = random.Random(900 + seed)
    devices, chunks = [(1, 2), (1, 3), (2, 2), (3, 2), (2, 3), (2, 2)][seed % 6]
    stages = devices * chunks
    problem = block_problem(rng, blocks=rng.randint(max(2, stages - 2), max(3, stages - 1)), devices=devices,
                            chunks=chunks, options=3 if stages <= 4 else 2)
    if seed % 4 == 1:
        problem = replace(problem, step_bytes=[GiB] + [GiB // 2] * (problem.num_layers - 3) + [0, GiB],
                          step_overhead_bytes=[GiB // 4] * devices)
    run = find_block_run(problem)
    expected = brute_force_partition(problem, allowed_starts=set(range(run.first, run.first + run.count + 1)),
                                     even_chunks=run)
    found = BlockPartitioner().solve(problem, run)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.status == "OPTIMAL"
        assert found.step_time_s == expected.step_time_s
