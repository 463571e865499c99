"""The planner: exact against brute force on random small instances, memory respected, and
the field's decision guide falling out of the optimiser."""
from __future__ import annotations

import random

import pytest

from autopar.config import PlanPins, SolverConfig
from autopar.model_file import load_model_file
from autopar.profile import profile_model
from tests.brute_force import brute_force_plan
from autopar.solver.planner import InfeasibleError, Planner
from autopar.solver.search import PlanSearch
from cost_models.step import TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec

_PROFILES: dict = {}


def profile_of(examples_dir, example: str, kwargs: dict, precision: str = "bf16"):
    key = (example, tuple(sorted(kwargs.items())), precision)
    if key not in _PROFILES:
        _PROFILES[key] = profile_model(load_model_file(examples_dir / example), kwargs, 1, precision)
    return _PROFILES[key]


def cluster(gpu: str, nodes: int, per_node: int, inter_GBps: float = 25.0) -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="test", gpu=gpu, nodes=nodes, gpus_per_node=per_node,
                                                 inter_node_bandwidth_GBps=inter_GBps))


MODELS = [
    ("gpt.py", {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 256, "vocab": 1024}),
    ("gpt.py", {"layers": 3, "hidden": 512, "heads": 8, "seq_len": 512, "vocab": 2048}),
    ("llama_hf.py", {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 688, "vocab": 1024,
                     "seq_len": 256}),
    ("mlp.py", {"width": 512, "layers": 3}),
]


@pytest.mark.parametrize("seed", range(20))
def test_search_matches_brute_force(examples_dir, seed):
    """On random (model, cluster, batch, memory) instances the CP-SAT search returns exactly the
    brute-force optimum's predicted step time, and never a plan over memory."""
    rng = random.Random(seed)
    example, kwargs = rng.choice(MODELS)
    profile = profile_of(examples_dir, example, kwargs)
    gpus = rng.choice([2, 4])
    spec = cluster(rng.choice(["A100-40GB", "H100-SXM", "L40S"]), nodes=rng.choice([1, 2]), per_node=gpus)
    # Memory sized to the model (beyond the CUDA context): roomy, or tight enough that ZeRO,
    # pipelining or recomputation is needed, or too small for anything.
    gpu = spec.node_gpus[0]
    need = 16 * profile.param_count + 8 * profile.activation_bytes
    room = rng.choice([2.0, 0.6, 0.35, 0.2, 0.02])
    squeezed = gpu.with_overrides(memory_bytes=int((0.8 * 2**30 + room * need) / 0.95))
    spec = ClusterSpec(name=spec.name, gpus_per_node=spec.gpus_per_node, node_gpus=(squeezed,) * spec.nodes,
                       intra=spec.intra, inter=spec.inter, memory_headroom_fraction=0.05)
    solver = SolverConfig(recompute_options=rng.choice([["none"], ["none", "full"]]), schedules=["1f1b", "gpipe"],
                          max_micro_batch_size=4, top_k=1)
    planner = Planner(profile, spec, TrainSpec(global_batch_size=rng.choice([4, 8])), solver, PlanPins())
    candidates = planner.candidates()
    expected = brute_force_plan(planner.pricer, candidates)
    found = PlanSearch(planner.pricer, time_limit_s=60).run(candidates)
    if expected is None:
        assert found.best == []
        return
    assert found.status == "OPTIMAL"
    assert found.best[0].step_time_s == pytest.approx(expected.step_time_s, rel=1e-12, abs=1e-9)
    problem = planner.pricer.partition_problem(found.best[0].candidate)
    assert all(used <= cap for used, cap in zip(found.best[0].partition.device_memory_bytes, problem.capacity_bytes))


@pytest.mark.parametrize("room", [0.35, 0.2, 0.1])
def test_memory_rows_refuse_exactly_what_the_whole_problem_refuses(examples_dir, room):
    """The search refuses a candidate for memory from its memory rows alone, before its times are
    priced: the verdict must be the whole problem's for every candidate (none lost, none let
    through), and the rows the problem's own."""
    from autopar.solver.bounds import memory_cannot_fit

    profile = profile_of(examples_dir, "gpt.py", {"layers": 3, "hidden": 512, "heads": 8, "seq_len": 512,
                                                  "vocab": 2048})
    spec = cluster("A100-40GB", nodes=2, per_node=4)
    gpu = spec.node_gpus[0]
    need = 16 * profile.param_count + 8 * profile.activation_bytes
    squeezed = gpu.with_overrides(memory_bytes=int((0.8 * 2**30 + room * need) / 0.95))
    spec = ClusterSpec(name=spec.name, gpus_per_node=4, node_gpus=(squeezed,) * 2, intra=spec.intra,
                       inter=spec.inter, memory_headroom_fraction=0.05)
    solver = SolverConfig(recompute_options=["none", "full"], schedules=["1f1b", "gpipe"], max_micro_batch_size=4)
    planner = Planner(profile, spec, TrainSpec(global_batch_size=8), solver, PlanPins())
    verdicts = []
    for candidate in planner.candidates():
        rows, problem = planner.pricer.memory_rows(candidate), planner.pricer.partition_problem(candidate)
        assert (rows is None) == (problem is None)
        if problem is None:
            continue
        assert (rows.static_bytes, rows.activation_bytes, rows.in_flight, rows.capacity_bytes,
                rows.overhead_bytes) == (problem.static_bytes, problem.activation_bytes, problem.in_flight,
                                         problem.capacity_bytes, problem.overhead_bytes)
        verdicts.append(memory_cannot_fit(rows))
    assert any(verdicts) and not all(verdicts)  # the instance has candidates on both sides
    # The search refusing on the rows finds what it found refusing each only once priced in full:
    # the same plan, and the same fastest refused candidates with the same bounds.
    early = PlanSearch(planner.pricer, time_limit_s=60).run(planner.candidates())
    late = PlanSearch(_PricedInFull(planner.pricer), time_limit_s=60).run(planner.candidates())
    assert [(b.step_time_s, b.index) for b in early.best] == [(b.step_time_s, b.index) for b in late.best]
    assert [item[:2] for item in early.over_memory] == [item[:2] for item in late.over_memory]
    assert early.rejected == late.rejected and early.priced == late.priced


GPT_1B = {"layers": 8, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304}


def plan_for(examples_dir, kwargs, spec, batch, **solver):
    profile = profile_of(examples_dir, "gpt.py", kwargs)
    settings = SolverConfig(time_limit_s=60, **solver)
    return Planner(profile, spec, TrainSpec(global_batch_size=batch), settings, PlanPins()).run().plan


def test_model_that_fits_one_gpu_gets_pure_data_parallelism(examples_dir):
    plan = plan_for(examples_dir, GPT_1B, cluster("H100-SXM", 1, 8), batch=64)
    assert (plan.dp, plan.tp, plan.pp, plan.cp) == (8, 1, 1, 1)


def test_states_that_do_not_fit_get_sharded(examples_dir):
    """~6.5B parameters need 16 B/param = 100+ GB of states: more than an A100-40GB holds."""
    big = {"layers": 8, "hidden": 8192, "heads": 64, "seq_len": 2048, "vocab": 50304}
    plan = plan_for(examples_dir, big, cluster("A100-40GB", 1, 8), batch=16)
    assert plan.zero_stage >= 1 or plan.pp > 1 or plan.tp > 1
    assert plan.predicted.peak_memory_bytes <= 40e9


def test_layer_too_big_for_a_gpu_gets_tp_or_zero3(examples_dir):
    """One block of hidden 16384 holds 3.2B parameters (51 GB of states): pipelining cannot
    split a layer, so only tensor parallelism or ZeRO-3 can fit it."""
    huge = {"layers": 2, "hidden": 16384, "heads": 128, "seq_len": 1024, "vocab": 32000}
    plan = plan_for(examples_dir, huge, cluster("A100-40GB", 1, 8), batch=8)
    assert plan.tp > 1 or plan.zero_stage == 3


def test_tp_stays_inside_a_node(examples_dir):
    big = {"layers": 8, "hidden": 8192, "heads": 64, "seq_len": 2048, "vocab": 50304}
    spec = cluster("A100-40GB", 2, 8)
    plan = plan_for(examples_dir, big, spec, batch=32)
    stride = 1
    for axis in plan.mesh_order:
        if axis == "tp":
            break
        stride *= plan.degree(axis)
    assert not spec.strided_placement(plan.tp, stride).crosses_nodes


def test_column_then_row_pairing_is_the_optimum(examples_dir):
    profile = profile_of(examples_dir, "gpt.py", GPT_1B)
    planner = Planner(profile, cluster("A100-80GB", 1, 8), TrainSpec(global_batch_size=8), SolverConfig(), PlanPins())
    split = planner.pricer.split("blocks.0", type("L", (), {"tp": 8, "cp": 1, "pp": 1, "dp": 1,
                                                            "mesh_order": ("tp", "cp", "pp", "dp"),
                                                            "degree": lambda self, a: getattr(self, a)})(),
                                 planner.cluster.node_gpus[0])
    assert split.styles == {"blocks.0.attn.q_proj": "colwise", "blocks.0.attn.k_proj": "colwise",
                            "blocks.0.attn.v_proj": "colwise", "blocks.0.attn.out_proj": "rowwise",
                            "blocks.0.mlp.fc_in": "colwise", "blocks.0.mlp.fc_out": "rowwise"}
    # Megatron's count: 2 all-reduces forward + 2 backward per block.
    assert [op for op, _ in split.comm] == ["all_reduce"] * 4


def test_nothing_fits_names_the_smallest_change(examples_dir):
    big = {"layers": 8, "hidden": 8192, "heads": 64, "seq_len": 2048, "vocab": 50304}
    profile = profile_of(examples_dir, "gpt.py", big)
    planner = Planner(profile, cluster("L40S", 1, 2), TrainSpec(global_batch_size=4),
                      SolverConfig(time_limit_s=20), PlanPins())
    with pytest.raises(InfeasibleError, match=r"Nothing fits.*Fix: use \d+× the nodes"):
        planner.run()


def test_min_gpus_picks_the_fewest_nodes_meeting_the_target(examples_dir):
    profile = profile_of(examples_dir, "gpt.py", GPT_1B)
    spec = cluster("A100-80GB", 4, 8)
    train = TrainSpec(global_batch_size=64)

    def fastest_on(nodes: int) -> float:
        sub = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=nodes, gpus_per_node=8))
        return Planner(profile, sub, train, SolverConfig(), PlanPins()).run().plan.predicted.tokens_per_s

    one, two = fastest_on(1), fastest_on(2)
    assert two > one
    target = (one + two) / 2  # one node is too slow, two nodes are enough
    plan = Planner(profile, spec, train, SolverConfig(objective="min_gpus", target_tokens_per_s=target),
                   PlanPins()).run().plan
    assert plan.world_size == 16 and plan.predicted.tokens_per_s >= target


def test_plan_round_trips_through_json_and_yaml(examples_dir, tmp_path):
    """A planned Plan (every field filled by the planner) survives JSON and YAML unchanged, and
    the solver record says how many candidates it priced out of the space."""
    from autopar.plans import Plan

    plan = plan_for(examples_dir, GPT_1B, cluster("H100-SXM", 2, 8), batch=64)
    assert 0 < plan.solver.priced <= plan.solver.candidates
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan
    plan.save(tmp_path / "plan.yaml")
    assert (tmp_path / "plan.yaml").read_text().startswith("dp:")
    assert Plan.load(tmp_path / "plan.yaml") == plan


def test_faster_plans_that_do_not_fit_are_named_with_their_overage(examples_dir):
    """With ZeRO pinned off, pure data parallelism would be fastest but its replicated states
    (~3.8B params x 16 B) overflow a 40 GB GPU: it is listed as a runner-up that lost on memory,
    with a prediction that is faster than the winner and a peak above the GPU."""
    shape = {"layers": 8, "hidden": 6144, "heads": 48, "seq_len": 1024, "vocab": 50304}
    profile = profile_of(examples_dir, "gpt.py", shape)
    spec = cluster("A100-40GB", 1, 8)
    result = Planner(profile, spec, TrainSpec(global_batch_size=64), SolverConfig(top_k=5),
                     PlanPins(zero_stage=0)).run()
    too_big = [a for a in result.alternatives if "over memory" in a.reason]
    assert too_big
    for alternative in too_big:
        assert alternative.plan.predicted.step_time_s < result.plan.predicted.step_time_s
        assert alternative.plan.predicted.peak_memory_bytes > 40e9
    assert result.plan.predicted.peak_memory_bytes <= 40e9


class _PricedInFull:
    """The planner's pricer without memory rows: every candidate is priced in full before its
    memory is checked (as the search did before it read the rows first)."""

    def __init__(self, pricer):
        self.pricer = pricer

    def memory_rows(self, candidate):
        return None

    def __getattr__(self, name):
        return getattr(self.pricer, name)


class _SlowPricer:
    """The planner's pricer with every full pricing delayed, as on a machine whose other core is
    busy: wall time grows, the deterministic work does not."""

    def __init__(self, pricer, delay_s: float):
        self.pricer, self.delay_s = pricer, delay_s

    def partition_problem(self, candidate):
        import time
        time.sleep(self.delay_s)
        return self.pricer.partition_problem(candidate)

    def compute_floor(self, candidate):
        return self.pricer.compute_floor(candidate)

    def memory_rows(self, candidate):
        return self.pricer.memory_rows(candidate)

    def fixed_time_s(self, candidate):
        return self.pricer.fixed_time_s(candidate)


def _gpt_on_128_h100(examples_dir) -> Planner:
    """A 16-layer GPT on 16 nodes of 8 H100: a search big enough to stop early (on 8 nodes the
    search proves its optimum after pricing 34 candidates, before any work limit is checked)."""
    profile = profile_of(examples_dir, "gpt.py", {"layers": 16, "hidden": 1024, "heads": 16, "seq_len": 512,
                                                  "vocab": 4096})
    return Planner(profile, cluster("H100-SXM", 16, 8), TrainSpec(global_batch_size=512), SolverConfig(top_k=1),
                   PlanPins())


def test_work_limit_gives_the_same_plan_on_a_slow_machine(examples_dir):
    """A search stopped by its deterministic work budget returns the same plan, gap and priced
    count whether pricing is fast or 1 ms slower per candidate (wall time is only a safety cap,
    here never reached); the unstopped search proves optimal a plan at least as fast."""
    planner = _gpt_on_128_h100(examples_dir)
    candidates = planner.candidates()
    full = PlanSearch(planner.pricer).run(candidates)
    budget = full.work / 2
    fast = PlanSearch(planner.pricer, work_limit=budget).run(candidates)
    slow = PlanSearch(_SlowPricer(planner.pricer, 1e-3), work_limit=budget).run(candidates)
    assert full.status == "OPTIMAL" and full.stopped_by == ""
    assert fast.stopped_by == slow.stopped_by == "work_limit" and fast.status == "FEASIBLE"
    assert (fast.best[0].index, fast.best[0].step_time_s, fast.gap, fast.priced, fast.work) == \
        (slow.best[0].index, slow.best[0].step_time_s, slow.gap, slow.priced, slow.work)
    # The slow pricer really was slow (each of its priced candidates slept 1 ms), whatever the load.
    assert slow.seconds >= slow.priced * 1e-3
    assert full.best[0].step_time_s <= fast.best[0].step_time_s
    assert fast.best[0].step_time_s * (1 - fast.gap) <= full.best[0].step_time_s + 1e-9


def test_cutoff_search_looks_only_below_the_cutoff(examples_dir):
    """The robust objective's second search is cut off at the pessimistic price of the plan it
    would replace: above the optimum it finds the same plan pricing fewer candidates; at the
    optimum it finds nothing (no plan is faster than a cutoff just below it) and says so without a plan."""
    planner = _gpt_on_128_h100(examples_dir)
    candidates = planner.candidates()
    full = PlanSearch(planner.pricer).run(candidates)
    best = full.best[0].step_time_s
    above = PlanSearch(planner.pricer).run(candidates, cutoff_s=best * 1.05)
    assert above.best[0].step_time_s == best and above.status == "OPTIMAL"
    assert above.priced <= full.priced
    at = PlanSearch(planner.pricer).run(candidates, cutoff_s=best * 0.999)
    assert at.best == [] and at.priced <= above.priced


def test_floor_with_communication_stays_below_every_option(examples_dir):
    """The search's floor (compute plus the least TP/CP exchange any recomputation option pays)
    never exceeds a layer's priced time under any option, for TP, Ulysses and ring CP layouts
    (a floor above a price would prune a plan that could win)."""
    profile = profile_of(examples_dir, "llama_hf.py", {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4,
                                                       "ffn": 688, "vocab": 1024, "seq_len": 1024})
    planner = Planner(profile, cluster("H100-SXM", 2, 8), TrainSpec(global_batch_size=8),
                      SolverConfig(max_micro_batch_size=2), PlanPins())
    checked = {"tp": 0, "ulysses": 0, "ring": 0}
    for candidate in planner.candidates():
        floor = planner.pricer.compute_floor(candidate)
        problem = planner.pricer.partition_problem(candidate)
        if floor is None or problem is None:
            continue
        for layer_s, row in zip(floor[0], problem.time_s):
            assert layer_s <= min(row) * (1 + 1e-12)
        checked["tp"] += candidate.tp > 1
        checked[candidate.cp_strategy] += candidate.cp > 1
    assert min(checked.values()) > 0


def test_robust_objective_prefers_the_plan_that_extrapolates_less(examples_dir):
    """On 128 nodes the fastest plan's data-parallel all-reduce spans all 128 (beyond the 48 any
    published InfiniBand run measured); the robust objective picks a plan whose interval overlaps
    it and whose pessimistic price is lower, says why in words, and lists the fastest as the first
    runner-up. objective=throughput keeps the fastest."""
    profile = profile_of(examples_dir, "gpt.py", {"layers": 12, "hidden": 6144, "heads": 48, "seq_len": 2048,
                                                  "vocab": 8192})
    spec = cluster("A100-80GB", 128, 8)
    train = TrainSpec(global_batch_size=1024)
    fastest = Planner(profile, spec, train, SolverConfig(objective="throughput", top_k=2), PlanPins()).run()
    planner = Planner(profile, spec, train, SolverConfig(top_k=2), PlanPins())
    robust = planner.run()
    assert robust.plan.summary() != fastest.plan.summary()
    assert robust.plan.predicted.step_time_s >= fastest.plan.predicted.step_time_s
    assert fastest.plan.predicted.extrapolated and "128 nodes" in fastest.plan.predicted.extrapolated[0]
    mine, theirs = fastest.plan.predicted, robust.plan.predicted
    # overlapping intervals; the chosen plan's upper end (its pessimistic price) is lower
    assert theirs.step_time_low_s <= mine.step_time_high_s and mine.step_time_low_s <= theirs.step_time_high_s
    assert theirs.step_time_high_s < mine.step_time_high_s
    note = robust.binding[0]
    assert note.constraint.startswith("robust objective") and "faster on paper" in note.relaxing \
        and "beyond any measurement" in note.relaxing
    assert robust.alternatives[0].plan.summary() == fastest.plan.summary()


def test_known_floors_bound_the_pessimistic_prices_and_keep_the_robust_answer(examples_dir):
    """What the first search proved of each candidate it priced (its partition problem's bound, a
    solve's bound) stays below that candidate's price under the robust objective's pessimistic
    prices; the robust search started from these floors finds exactly the plan it finds from the
    compute floors, pricing fewer candidates (here about half: the plan it finds was never priced
    by the first search)."""
    from autopar.solver.stage_partition import StagePartitioner
    from cost_models.step import PlanPricer
    from cost_models.uncertainty import pessimistic_cluster

    profile = profile_of(examples_dir, "gpt.py", {"layers": 12, "hidden": 6144, "heads": 48, "seq_len": 2048,
                                                  "vocab": 8192})
    planner = Planner(profile, cluster("A100-80GB", 128, 8), TrainSpec(global_batch_size=1024),
                      SolverConfig(top_k=2), PlanPins())
    candidates = planner.candidates()
    first = PlanSearch(planner.pricer, top_k=2)
    fastest = first.run(candidates).best[0]
    known = first.known_floors()
    raised = [entry for entry, floor in zip(sorted(known, key=lambda e: e[1]),
                                            sorted((f for f in first.floors if f[1] in first.proven),
                                                   key=lambda e: e[1]))
              if entry[0] > floor[0]]
    assert len(raised) > 10  # the bounds were tighter than the compute floors for many candidates
    extrapolation = planner._extrapolation(planner._layout(fastest))
    cautious = PlanPricer(profile, pessimistic_cluster(planner.cluster, extrapolation), planner.train,
                          planner.splitter, recompute_options=planner.pricer.recompute_options)
    for bound, _, candidate in raised[:: max(1, len(raised) // 12)]:
        problem = cautious.partition_problem(candidate)
        solved = StagePartitioner().solve(problem)
        assert solved is not None and bound <= solved.step_time_s + cautious.fixed_time_s(candidate) + 1e-9
    cutoff = planner.interval(fastest).pessimistic_s
    plain = PlanSearch(cautious).run(candidates, cutoff_s=cutoff, floors=first.floors)
    informed = PlanSearch(cautious).run(candidates, cutoff_s=cutoff, floors=known)
    assert [(s.index, s.step_time_s) for s in informed.best] == [(s.index, s.step_time_s) for s in plain.best]
    assert informed.best and informed.priced < plain.priced


def test_robust_objective_prefers_the_plan_whose_cost_is_better_known(examples_dir, monkeypatch):
    """With a calibration whose out-of-sample error falls steeply beyond 2 data-parallel ranks, the
    fastest plan on one H100 node (the widest data-parallel group) gets the widest interval; the
    robust objective takes a runner-up whose interval overlaps it and whose top is lower, and says
    the fastest plan's cost is less known. objective=throughput keeps the fastest."""
    import cost_models.uncertainty as uncertainty
    from cost_models.uncertainty import ScaleTrend

    steep = ScaleTrend.fit("data_parallel_ranks", [1, 2, 2, 1], [0.0, -0.3, -0.32, 0.02])
    monkeypatch.setattr(uncertainty, "SCALE_TRENDS", {"data_parallel_ranks": steep})
    profile = profile_of(examples_dir, "gpt.py", {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 256,
                                                  "vocab": 1024})
    spec = cluster("H100-SXM", 1, 8)
    train = TrainSpec(global_batch_size=64)
    fastest = Planner(profile, spec, train, SolverConfig(objective="throughput", top_k=4), PlanPins()).run()
    robust = Planner(profile, spec, train, SolverConfig(top_k=4), PlanPins()).run()
    assert fastest.plan.dp * fastest.plan.cp > 2
    assert robust.plan.summary() != fastest.plan.summary()
    mine, theirs = fastest.plan.predicted, robust.plan.predicted
    assert theirs.step_time_low_s <= mine.step_time_high_s and mine.step_time_low_s <= theirs.step_time_high_s
    assert theirs.step_time_high_s < mine.step_time_high_s
    note = robust.binding[0].relaxing
    assert "cost is less known" in note and "ranks in a data-parallel group" in note
    assert robust.alternatives[0].plan.summary() == fastest.plan.summary()


def test_collector_paused_while_planning_and_restored_after():
    """Planning pauses the cyclic garbage collector (allocation-triggered collections walked the
    whole heap) and leaves it as it found it, enabled or not, even when planning raises."""
    import gc

    from autopar.solver.planner import collector_paused

    assert gc.isenabled()
    with pytest.raises(ValueError):
        with collector_paused():
            assert not gc.isenabled()
            raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_cross_node_tp_explanation_prices_tp_packed_into_whole_nodes(examples_dir, monkeypatch):
    """The "TP kept inside a node" explanation searches plans whose TP groups span nodes, each
    group packed into whole nodes (2 nodes of 4 for tp=8), never a strided placement (8 nodes
    of 1): those cost an operator-wise solve per layer kind and placement, for plans no faster."""
    from types import SimpleNamespace

    import autopar.solver.planner as planner_module
    from autopar.solver.space import enumerate_candidates
    from autopar.domain.mesh import Mesh

    profile = profile_of(examples_dir, "gpt.py", {"layers": 2, "hidden": 256, "heads": 16, "seq_len": 64,
                                                  "vocab": 1024})
    planner = Planner(profile, cluster("H100-SXM", 8, 4), TrainSpec(global_batch_size=32, precision="bf16"),
                      SolverConfig(top_k=0), PlanPins())
    searched: list = []

    class Recording:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, candidates):
            searched.extend(candidates)
            return SimpleNamespace(best=[])

    monkeypatch.setattr(planner_module, "PlanSearch", Recording)
    assert planner._cross_node_tp_gain(None) == "no plan with TP across nodes fits in memory"
    assert {c.tp for c in searched} == {8, 16}
    def packed(c) -> bool:
        degrees = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp}
        return Mesh.from_degrees(c.mesh_order, degrees).span("tp", 4) == (c.tp // 4, 4)

    offered = [c for c in enumerate_candidates(planner.shape, 32, 4, 32, SolverConfig(allow_cross_node_tp=True),
                                               PlanPins()) if c.tp > 4]
    assert any(not packed(c) for c in offered)  # strided placements exist, and are left out
    assert searched == [c for c in offered if packed(c)]
