"""Layer-wise pipeline partition: contiguous layers to stages, with per-layer recomputation,
balancing stage time under per-stage memory limits (CP-SAT).

Inputs are already priced by the cost model: for layer l and recompute option r, the
training time of one micro-batch `time_s[l][r]` (forward + backward + recomputation) on a
reference device, its activation bytes per in-flight micro-batch `activation_bytes[l][r]`,
and its micro-batch-independent bytes `static_bytes[l]` (parameters, gradients, optimizer
states as the ZeRO stage shards them). Each pipeline stage j (virtual stage with interleaving)
runs on device d(j) = j mod p, which has a speed factor (time multiplier; heterogeneous
clusters) and a memory capacity; at each moment q of its schedule that can be its activation
peak it holds `in_flight[d][q][c]` micro-batches of its chunk c's activations
(`cost_models.held_activations`; chunk c of device d is virtual stage j = c·p + d).

The program (`StagePartitioner.solve`):

    variables  x[l,j] ∈ {0,1} layer l on virtual stage j    y[l,r] ∈ {0,1} layer l uses option r
               w[l,j,r] = x[l,j] ∧ y[l,r]                     (`_add_assignment`)
               D_d ≥ 0 device time per micro-batch, M ≥ D_d for all d    (`_add_device_times`)
    constraints every layer on one stage and one option; stages contiguous and non-empty:
               s(l) = Σ_j j·x[l,j], s(0) = 0, s(L-1) = P-1, s(l) ≤ s(l+1) ≤ s(l) + 1
                                                                 (`_add_contiguity`)
               Σ_{l,r,j on d} (static_bytes[l] + in_flight[d][q][j div p]·activation_bytes[l][r])·w[l,j,r]
                   + overhead_bytes[d] ≤ capacity[d]  for every q (`_add_memory_limits`)
               Σ_{l,r,j on d} (static_bytes[l] + step_bytes[l])·w[l,j,r]
                   + step_overhead_bytes[d] ≤ capacity[d]        (the optimizer step, where priced)
               E ≥ speed[d]·Σ_{l, j on d} per_step_s[l]·x[l,j] for all d
    objective  min (m - 1)·M + (1/v)·Σ_d D_d + (1 - 1/v)·M + E, with D_d = speed[d]·Σ_{j on d} T_j
               and T_j = Σ_{l,r} time_s[l][r]·w[l,j,r] + send_s[l]·(l is the last layer of j)

`per_step_s[l]` is time spent once per step for layer l (the exposed part of its gradient
synchronisation and its optimizer update): the slowest device's sum is added once.
The objective is the pipeline step time of `cost_models.pipeline.pipeline_step_time_s` (GPipe, 1F1B and
interleaved 1F1B share it; they differ in `in_flight`): for equal stages it is
(m + (p-1)/v)·D, the bubble fraction (p-1)/(v·m) of Narayanan et al. 2021, eq. for the
interleaved schedule; for unequal stages the fill and drain pass every stage once and the
steady state is paced by the slowest device.
tests/brute_force.py enumerates every partition and option to check it.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

# CP-SAT is imported where a model is built: it imports pandas (about 1 s of a planning process),
# which a plan that solves no CP-SAT model (identical blocks, tensor-parallel splits kept with the
# profile: autopar.profile_cache) never needs.
if TYPE_CHECKING:
    from ortools.sat.python import cp_model

from cost_models.pipeline import (TIME_UNITS_PER_S, Partition, PartitionProblem, evaluate, mib_down, mib_up,
                                   time_units)


def solve_deterministically(model: cp_model.CpModel, time_limit_s: float, seed: int, workers: int):
    """Solve with a deterministic work limit (CP-SAT's deterministic seconds) rather than wall
    time, so the same inputs give the same answer on any machine load."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    return solver, solve_interruptibly(solver, model)


def solve_interruptibly(solver: cp_model.CpSolver, model: cp_model.CpModel) -> int:
    """``solver.solve(model)``, stopped by Ctrl-C like any Python code.

    CP-SAT's own SIGINT catcher (``catch_sigint_signal``) would take the first Ctrl-C as "stop
    searching" (the plan looks finished) and, once the solve returns, leave SIGINT's default
    action behind, so a later Ctrl-C kills the process by signal with its staging folders and
    check ranks left over. It is switched off; the solve runs on a thread (it releases the GIL)
    while this one waits, so Ctrl-C raises KeyboardInterrupt here, which stops the search."""
    solver.parameters.catch_sigint_signal = False
    outcome: list[Any] = []  # the solve's status (OR-Tools' CpSolverStatus)
    worker = threading.Thread(target=lambda: outcome.append(solver.solve(model)), name="cp-sat", daemon=True)
    worker.start()
    try:
        worker.join()
    except BaseException:
        solver.stop_search()
        worker.join()
        raise
    return outcome[0]


def priced_solution(problem: PartitionProblem, starts: list[int], options: list[int], status: str,
                    bound_units: float) -> Partition:
    """Price the decoded solution with `evaluate` and attach the solver's status and its proven
    lower bound (`bound_units` in the programs' objective units, v·µs)."""
    result = evaluate(problem, starts, options)
    if result is None:  # evaluate() uses the programs' own units: this would be a bug
        raise AssertionError("partition program's answer breaks a memory limit")
    bound = bound_units / problem.chunks / TIME_UNITS_PER_S
    return Partition(result.stage_starts, result.options, result.step_time_s, result.device_time_s,
                     result.device_memory_bytes, status,
                     result.step_time_s if status == "OPTIMAL" else min(bound, result.step_time_s))


def units_bound(seconds: list[float], speed: float) -> int:
    """An upper bound of a sum of `time_units` terms at ``speed``: the terms rounded as the
    constraints round them. Rounding the sum instead undercounts (each term may round up by half
    a unit), which made a problem of five tiny per-step times infeasible (DeepSeek-V3's toy at
    tp2: 58 units of terms against a bound of 57)."""
    return sum(time_units(speed * s) for s in seconds) + 1


def unresolved(problem: PartitionProblem, status: str, bound_units: float) -> Partition | None:
    """None when the problem is proven infeasible; otherwise (work limit reached before any
    solution) a placeholder with no partition and the proven lower bound (objective units)."""
    if status == "INFEASIBLE":
        return None
    return Partition([], [], float("inf"), [], [], status, max(0.0, bound_units) / problem.chunks / TIME_UNITS_PER_S)


class StagePartitioner:
    """Solves the program in the module docstring."""

    def __init__(self, time_limit_s: float = 20.0, seed: int = 0, workers: int = 1):
        self.time_limit_s = time_limit_s  # CP-SAT deterministic seconds per solve
        self.seed = seed
        self.workers = workers
        self.work_s = 0.0  # deterministic seconds spent by all solves so far (the search's budget)

    def solve(self, problem: PartitionProblem) -> Partition | None:
        """Optimal partition, or None when no partition fits in memory."""
        L, P, options = problem.num_layers, problem.num_stages, len(problem.time_s[0])
        if L < P:
            return None
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        x, w, last = self._add_assignment(model, problem, L, P, options)
        self._add_contiguity(model, x, last, L, P)
        self._add_memory_limits(model, problem, w, L, P, options)
        slowest, device_time = self._add_device_times(model, problem, w, last, L, P, options)
        once = self._add_per_step_time(model, problem, x, L, P)
        v, m = problem.chunks, problem.micro_batches
        # Objective scaled by v so every coefficient is an integer.
        model.minimize(((m - 1) * v + (v - 1)) * slowest + sum(device_time) + v * once)
        solver, status = solve_deterministically(model, self.time_limit_s, self.seed, self.workers)
        self.work_s += solver.deterministic_time
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return unresolved(problem, solver.status_name(status), solver.best_objective_bound)
        starts = [layer for layer in range(L)
                  if layer == 0 or any(solver.value(last[(layer - 1, j)]) for j in range(P - 1))]
        chosen = [next(r for j in range(P) for r in range(options) if solver.value(w[(layer, j, r)]))
                  for layer in range(L)]
        return priced_solution(problem, starts, chosen, solver.status_name(status), solver.best_objective_bound)

    def _add_assignment(self, model, problem, L, P, options):
        x = {(layer, j): model.new_bool_var(f"x[{layer},{j}]") for layer in range(L) for j in range(P)}
        y = {(layer, r): model.new_bool_var(f"y[{layer},{r}]") for layer in range(L) for r in range(options)}
        w = {}
        for layer in range(L):
            model.add_exactly_one(x[(layer, j)] for j in range(P))
            model.add_exactly_one(y[(layer, r)] for r in range(options))
            for j in range(P):
                for r in range(options):
                    var = model.new_bool_var(f"w[{layer},{j},{r}]")
                    model.add_multiplication_equality(var, [x[(layer, j)], y[(layer, r)]])
                    w[(layer, j, r)] = var
                model.add(sum(w[(layer, j, r)] for r in range(options)) == x[(layer, j)])
        # last[l, j]: layer l is the last layer of stage j (it sends to stage j + 1).
        last = {}
        for layer in range(L - 1):
            for j in range(P - 1):
                var = model.new_bool_var(f"last[{layer},{j}]")
                model.add_multiplication_equality(var, [x[(layer, j)], x[(layer + 1, j + 1)]])
                last[(layer, j)] = var
        return x, w, last

    def _add_contiguity(self, model, x, last, L, P):
        stage = [sum(j * x[(layer, j)] for j in range(P)) for layer in range(L)]
        model.add(stage[0] == 0)
        model.add(stage[L - 1] == P - 1)
        for layer in range(L - 1):
            model.add(stage[layer] <= stage[layer + 1])
            model.add(stage[layer + 1] <= stage[layer] + 1)

    def _add_memory_limits(self, model, problem, w, L, P, options):
        """Each device's memory in backward and, where priced, at the optimizer step."""
        for device in range(problem.devices):
            capacity = mib_down(problem.capacity_bytes[device])
            for moment in problem.in_flight[device]:  # every moment that can be the peak
                terms = [mib_up(problem.held_bytes(layer, r, moment[j // problem.devices])) * w[(layer, j, r)]
                         for j in range(device, P, problem.devices) for layer in range(L) for r in range(options)]
                model.add(sum(terms) + mib_up(problem.overhead_bytes[device]) <= capacity)
            if problem.step_bytes:
                step_terms = [mib_up(problem.at_step_bytes(layer)) * w[(layer, j, r)]
                              for j in range(device, P, problem.devices) for layer in range(L) for r in range(options)]
                model.add(sum(step_terms) + mib_up(problem.step_overhead_bytes[device]) <= capacity)

    def _add_device_times(self, model, problem, w, last, L, P, options):
        fastest = max(problem.speed or [1.0])
        horizon = 2 * units_bound([max(row) for row in problem.time_s] + list(problem.send_s), fastest)
        slowest = model.new_int_var(0, horizon, "slowest")
        device_time = []
        for device in range(problem.devices):
            speed = problem.speed_of(device)
            terms = []
            for j in range(device, P, problem.devices):
                terms += [time_units(speed * problem.time_s[layer][r]) * w[(layer, j, r)]
                          for layer in range(L) for r in range(options)]
                if j < P - 1:
                    terms += [time_units(speed * problem.send_s[layer]) * last[(layer, j)] for layer in range(L - 1)]
            var = model.new_int_var(0, horizon, f"D[{device}]")
            model.add(var == sum(terms))
            model.add(slowest >= var)
            device_time.append(var)
        return slowest, device_time

    def _add_per_step_time(self, model, problem, x, L, P):
        """E ≥ the once-per-step time of every device (0 when the problem has none)."""
        if not problem.per_step_s:
            return 0
        horizon = units_bound(problem.per_step_s, max(problem.speed or [1.0]))
        once = model.new_int_var(0, horizon, "per_step")
        for device in range(problem.devices):
            speed = problem.speed_of(device)
            model.add(once >= sum(time_units(speed * problem.per_step_s[layer]) * x[(layer, j)]
                                  for j in range(device, P, problem.devices) for layer in range(L)))
        return once
