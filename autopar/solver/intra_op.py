"""Operator-wise tensor parallelism: an Alpa-style ILP over one layer's forward graph.

Given a layer of the profiled graph and a TP degree t, choose for every op how it runs on the
TP group, so that compute (divided by t where sharded) plus resharding communication is least.
Megatron's column-then-row pairing is not written anywhere here: it is what the optimum is.

Sharding states of a tensor (DTensor vocabulary on the TP axis):
    R = Replicate(), S = Shard(feature/head dim), P = Partial() (sum pending).

The program (built by `IntraOpSolver.solve`):

    variables   x[v,k] ∈ {0,1}   op v runs strategy k              (`_add_strategy_choice`)
                e[u,v,a,b] ∈ {0,1}  edge u→v carries state a out of u and b into v
                                                                  (`_add_edge_linearisation`)
                g[u] ∈ {0,1}     tensor u (state R) feeds a column-parallel op, so its gradient
                                 needs one all-reduce in backward   (`_add_backward_all_reduce`)
    constraints Σ_k x[v,k] = 1 for every op v
                Σ_b e[u,v,a,b] = Σ_{k: out(k)=a} x[u,k],  Σ_a e[u,v,a,b] = Σ_{k: in(k)=b} x[v,k]
                g[u] ≥ x[v,col] for every column-parallel consumer v of u
                ops leaving the layer produce R (the residual stream between layers)
                                                                  (`_add_layer_outputs_replicated`)
                a column-parallel GEMM outside a paired region feeds its consumers R: codegen
                gathers its output at once (ColwiseParallel(output_layouts=Replicate()))
                                                                  (`_add_gathered_outputs`)
    objective   min Σ x[v,k]·compute(v,k) + Σ e[u,v,a,b]·reshard(a→b, bytes(u)) + Σ g[u]·AR(bytes(u))

Only reshardings a module-level TP plan (torch's parallelize_module styles) can express are
offered, so every solution can be generated as code: S→R all-gather (a colwise layer with a
replicated output), P→R all-reduce (rowwise). Strategies per op: a parameterised GEMM may replicate
(R→R, full cost), go column-parallel
(R→S, cost/t, backward all-reduce of its input's gradient) or row-parallel (S→P, cost/t); a
key/value projection of grouped-query attention with kv < t heads may instead compute its
group's head (R→S, cost/kv, the input's all-reduce shared, plus its weight's all-gather in
forward and its gradient's reduce-scatter in backward: autopar.solver.tp_kv_groups), and a column
split, which would cut a head, is not offered; an
embedding may replicate, split its vocabulary (→P) or its hidden dim (→S); attention, views,
elementwise and memory ops run all-R or all-S; reductions and norms (which reduce over the
feature dim) need R, except a per-head norm's (Qwen3's q_norm: over each head's features), which
may run on head shards for an all-reduce of its weight's gradient (autopar.solver.tp_head_norms),
and a softmax of attention scores written out (a product of two activations, the causal mask a
constant beside them: Megatron-LM's attention before fused kernels, Hugging Face's "eager" one),
which stays inside each head;
a random draw (dropout) may run on the rank's shard, its region then seeded per rank;
an op computing with a parameter that no split style shards (xIELU's trainable scalars inside
Apertus's MLP, DiffLlama's lambdas, a layer scale) runs R: on a rank's share its parameter's
gradient would be that share's part, never summed over the group;
ops no split strategy covers (sorting, scans, FFTs along a dimension,
and ops of unknown kind) fall back to R and are listed in the solution (`replicated_ops`) so the
report can say so; the loss may take vocabulary-sharded logits (loss parallel) for three
small all-reduces. Compute of an op counts forward and backward: its forward cost times its module's
backward/forward ratio from the profile. A split divides the whole of that, kernel launches
included, where the layer's price (autopar.solver.tp_split) divides only the roofline: a known
bias towards splitting where launches are most of an op's time. Dividing only the roofline here
was tried: at the zoo's widths every split then prices slower than replicating (hf_llama at a
pinned tp=2 split 67% of its linear parameters, BERT none), so the bias stays and the zoo's
tiny models keep exercising the splits; at real widths launches are a small share.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from autopar.model_profile import inside
from autopar.solver.stage_partition import solve_deterministically
from autopar.domain.vocabulary import TPStyle
from cost_models.weights import parameter_sources

if TYPE_CHECKING:
    from ortools.sat.python import cp_model  # imported where a model is built (stage_partition says why)

    from autopar.model_profile import ModelProfile, OpProfile

TIME_UNITS_PER_S = 1e9  # CP-SAT needs integers: costs are scaled to nanoseconds


class State(StrEnum):
    R = "Replicate()"
    S = "Shard(feature)"
    P = "Partial()"


Style = TPStyle  # the plan's vocabulary (autopar.domain.layout), as the solution names it


class TPCosts(Protocol):
    """Prices the ILP needs: per-op compute time on one GPU and collectives on the TP group."""

    def op_time_s(self, op: "OpProfile") -> float: ...
    def all_reduce_s(self, nbytes: float) -> float: ...
    def all_gather_s(self, nbytes: float) -> float: ...
    def reduce_scatter_s(self, nbytes: float) -> float: ...


@dataclass(frozen=True)
class Strategy:
    name: str
    inputs: State  # required state of every activation input
    output: State
    compute_divisor: bool  # compute divided by t
    style: Style | None = None  # meaning for a parameterised module
    splits_input: bool = False  # column-parallel: backward all-reduce of the input gradient
    extra_comm: str | None = None  # "loss_parallel": three all-reduces of b·s floats; "kv_group": its weight's gather


@dataclass
class IntraOpSolution:
    """Chosen strategy per op and what it costs per training step of the layer (one micro-batch)."""

    layer: str
    tp: int
    op_strategy: dict[str, str]
    module_style: dict[str, Style]
    compute_s: float
    comm_s: float
    comm_events: list[tuple[str, str, float]] = field(default_factory=list)  # (collective, tensor, bytes)
    status: str = "OPTIMAL"
    replicated_ops: list[tuple[str, str]] = field(default_factory=list)  # (op target, module): no split covers it

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


_REPLICATE = Strategy("replicate", State.R, State.R, False, Style.REPLICATE)
_COLWISE = Strategy("colwise", State.R, State.S, True, Style.COLWISE, splits_input=True)
_ROWWISE = Strategy("rowwise", State.S, State.P, True, Style.ROWWISE)
_ALL_R = Strategy("R", State.R, State.R, False)
_ALL_S = Strategy("S", State.S, State.S, True)
_VOCAB = Strategy("vocab_parallel", State.R, State.P, True, Style.VOCAB_PARALLEL)
_HIDDEN = Strategy("hidden_parallel", State.R, State.S, True, Style.HIDDEN_PARALLEL)
_LOSS_PARALLEL = Strategy("loss_parallel", State.S, State.R, True, extra_comm="loss_parallel")
_VIEW_P = Strategy("P", State.P, State.P, False)
# Compute divided by the key/value heads, not t (each rank computes its group's head)
_KV_GROUP = Strategy("kv_group", State.R, State.S, False, Style.KV_GROUP, splits_input=True, extra_comm="kv_group")
# An op reading only its input's shape (dropout's empty_like): a pending sum's shape is the
# whole's, so it makes a whole, replicated tensor without the sum being taken
_SHAPE_OF_PARTIAL = Strategy("shape", State.P, State.R, False)
# A norm over each head's features on the rank's heads: its weight's gradient all-reduced
_HEAD_NORM = Strategy("head_norm", State.S, State.S, True, Style.HEAD_NORM, extra_comm="head_norm")

# Resharding a module-level TP plan can express: local ops keep their state, a colwise output
# can be gathered (output_layouts=Replicate()), a rowwise output all-reduced (the default).
# Slicing a replicated activation or reduce-scattering onto the feature dim is not offered.
_REALISABLE = {(State.R, State.R), (State.S, State.S), (State.P, State.P), (State.S, State.R), (State.P, State.R)}

_LOSS_TARGETS = ("_log_softmax", "nll_loss_forward", "cross_entropy")

# Ops that combine values along a dimension that may be the sharded one (sorts, selections,
# scans, FFTs): run on a shard they would give a different answer, and no strategy here splits
# them, so they run replicated. Ops of unknown kind (class "other") are treated the same way.
_UNSPLITTABLE_OPS = {"sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode", "cumsum",
                     "cumprod", "cummax", "cummin", "logcumsumexp", "searchsorted", "unique_dim",
                     "unique_consecutive", "_unique2"}


# Draws of one number per element of their input's shape (dropout's bernoulli_, noise): a shard's
# are as good as the whole's, given their own generator. A draw across a dim (multinomial) is not.
_ELEMENTWISE_DRAWS = {"bernoulli", "rand_like", "randn_like", "normal", "uniform", "exponential", "cauchy",
                      "geometric", "log_normal", "random", "poisson"}


# Ops whose output takes only the shape (and dtype) of their input, never its values (the
# shape-only draws, rand_like and randn_like, are taken as draws: `draws_random` first).
_SHAPE_ONLY = {"empty_like", "zeros_like", "ones_like", "full_like"}


def _packet(op: "OpProfile") -> str:
    """The op's overload packet name ("aten.bernoulli_.float" -> "bernoulli_"); a non-ATen
    target as it is."""
    return op.target.split(".")[1] if op.target.startswith("aten.") else op.target


def _reads_shape_only(op: "OpProfile") -> bool:
    return len(op.inputs) == 1 and _packet(op) in _SHAPE_ONLY


def draws_random(op: "OpProfile") -> bool:
    """Whether ``op`` draws random numbers (dropout's ``bernoulli_``, ``rand_like``...). On a
    rank's shard it must draw its own numbers: the generated code runs the paired region holding
    it with the generators seeded per rank (``RankRandomNumbers``; the plan's
    ``tp_random_regions``). It is never a partial sum's op: a mask of a sum is no sum of masks."""
    packet = _packet(op)
    return packet.rstrip("_") in _ELEMENTWISE_DRAWS or packet == "native_dropout"


def unsplittable(op: "OpProfile") -> bool:
    """Whether no TP strategy covers the op (it must see whole activations)."""
    packet = _packet(op)
    return op.op_class == "other" or packet in _UNSPLITTABLE_OPS or "fft" in packet


@dataclass(frozen=True)
class OpIndex:
    """Lookups over a profile's ops that every per-layer solve needs, built once per profile
    (each solve scanned every op of the model for them: about 0.6 s of planning the 405B Llama
    on 16,384 H100).

    Attributes:
        by_layer: each layer's ops (both phases) in trace order.
        forward_readers: tensor name -> the layers whose forward ops read it.
        derived: `cost_models.weights.parameter_derived(profile)`.
        trainable: those of them a parameter flows into -> the parameters' FQNs.
        split_modules: modules whose own GEMM or embedding reads a parameter: what a split
            style shards (its weight, and a bias it adds beside the GEMM).
    """

    by_layer: dict[str | None, list]
    forward_readers: dict[str, set]
    derived: set[str]
    trainable: dict[str, frozenset[str]] = field(default_factory=dict)
    split_modules: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, profile: "ModelProfile") -> "OpIndex":
        by_layer: dict[str | None, list] = {}
        readers: dict[str, set] = {}
        for op in profile.ops:
            by_layer.setdefault(op.layer, []).append(op)
            if op.phase == "forward":
                for source in op.inputs:
                    readers.setdefault(source, set()).add(op.layer)
        derived, trainable = parameter_sources(profile)
        split = {op.module for op in profile.ops if op.phase == "forward" and op.module is not None
                 and (op.op_class == "gemm" or "embedding" in op.target)
                 and any(name in trainable for name in op.inputs)}
        return cls(by_layer, readers, derived, trainable, split)


class IntraOpSolver:
    """Builds and solves the program in the module docstring for one layer."""

    def __init__(self, profile: "ModelProfile", costs: TPCosts, tp: int, time_limit_s: float = 10.0,
                 seed: int = 0, replicated_modules: frozenset[str] = frozenset(),
                 gathered_modules: frozenset[str] = frozenset(), index: "OpIndex | None" = None,
                 kv_group_modules: dict[str, tuple[float, tuple[float, ...]]] | None = None,
                 head_norms: dict[str, tuple[float, ...]] | None = None,
                 not_colwise: frozenset[str] = frozenset(), whole_draws: bool = False):
        self.profile = profile
        # Random draws run on whole activations only (a region keeping DTensor activations: its
        # draws would go through DTensor's own generator offsets, which recomputation does not
        # replay; autopar.solver.tp_split.ILPSplitter.split)
        self.whole_draws = whole_draws
        # Modules offered no column split (a region's output projection, held to pair with its
        # key/value groups: autopar.solver.tp_split.ILPSplitter._solve)
        self.not_colwise = not_colwise
        # Reductions of per-head norm modules -> bytes of each of the module's parameters:
        # offered head_norm beside R (autopar.solver.tp_head_norms).
        self.head_norms = head_norms or {}
        # Key/value projections with fewer heads than ranks -> (how many times less work a rank
        # does: the key/value heads, more for a fused projection whose query part splits by tp;
        # bytes of each parameter's gathered rows): offered kv_group instead of a column split
        # (autopar.solver.tp_kv_groups).
        self.kv_group_modules = kv_group_modules or {}
        # Modules whose split the model's code cannot run (autopar.solver.tp_legality): only
        # their replicated strategy is offered, so no illegal split is ever priced.
        self.replicated_modules = replicated_modules
        # Column-parallel modules outside a paired region: codegen gathers their output at once,
        # so no consumer may read it sharded (see ILPSplitter._solve, which finds them).
        self.gathered_modules = gathered_modules
        self.costs = costs
        self.tp = tp
        self.time_limit_s = time_limit_s
        self.seed = seed
        # Shared by a caller that solves many layers of one profile (building it scans every op)
        self.index = index if index is not None else OpIndex.of(profile)
        self._params = self.index.derived

    def solve(self, layer: str) -> IntraOpSolution:
        ops = [op for op in self.index.by_layer.get(layer, []) if op.phase == "forward" and op.name not in self._params]
        by_name = {op.name: op for op in ops}
        backward_ratio = self._backward_ratio(layer)
        norms = self._head_norm_modules(ops)
        strategies = {op.name: self._strategies(op, by_name, frozenset(norms)) for op in ops}
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        choice = self._add_strategy_choice(model, strategies)
        objective: list[tuple[int, cp_model.IntVar]] = []
        compute_terms: dict[tuple[str, int], float] = {}
        for op in ops:
            base = self.costs.op_time_s(op) * (1.0 + backward_ratio.get(op.module, backward_ratio[None]))
            for index, strategy in enumerate(strategies[op.name]):
                seconds = base / self.tp if strategy.compute_divisor else base
                if strategy.extra_comm == "loss_parallel":
                    seconds += 3 * self.costs.all_reduce_s(self._loss_parallel_bytes(op))
                if strategy.extra_comm == "head_norm":  # priced per micro-batch: issued once a step or more
                    seconds += sum(self.costs.all_reduce_s(nbytes) for nbytes in self._head_norm_gradients(op, norms))
                if strategy.extra_comm == "kv_group":
                    divisor, parameters = self.kv_group_modules[op.module]
                    seconds = base / divisor + sum(self.costs.all_gather_s(nbytes) + self.costs.reduce_scatter_s(nbytes)
                                                  for nbytes in parameters)
                compute_terms[(op.name, index)] = seconds
                objective.append((_units(seconds), choice[(op.name, index)]))
        edges = self._edges(ops, by_name)
        edge_vars = self._add_edge_linearisation(model, edges, strategies, choice)
        for (source, target, state_out, state_in), var in edge_vars.items():
            objective.append((_units(self._reshard_s(state_out, state_in, by_name[source])), var))
        self._add_gathered_outputs(model, edge_vars, by_name)
        self._add_column_shards_stay_in_region(model, edge_vars, by_name)
        all_reduce_vars = self._add_backward_all_reduce(model, edges, strategies, choice, by_name)
        for source, var in all_reduce_vars.items():
            objective.append((_units(self.costs.all_reduce_s(self._bytes(by_name[source]))), var))
        self._add_layer_outputs_replicated(model, ops, strategies, choice)
        self._add_head_norms_whole(model, norms, strategies, choice)
        model.minimize(sum(coefficient * var for coefficient, var in objective))

        # A deterministic work limit, not wall time: the same split on a busy or an idle machine;
        # one worker, deterministic and fast enough for one layer.
        solver, status = solve_deterministically(model, self.time_limit_s, self.seed, workers=1)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise RuntimeError(f"intra-op ILP for {layer} at tp={self.tp}: {solver.status_name(status)}")
        solution = self._read_solution(layer, solver, status, ops, strategies, choice, compute_terms, edge_vars,
                                       all_reduce_vars, by_name)
        solution.replicated_ops = [(op.target, op.module or layer) for op in ops if self.tp > 1 and unsplittable(op)
                                   and any(name in by_name or not self._is_param(name) for name in op.inputs)]
        return solution

    # -- constraints -------------------------------------------------------------------------

    def _add_strategy_choice(self, model: cp_model.CpModel, strategies: dict[str, list[Strategy]]):
        choice = {}
        for name, options in strategies.items():
            variables = [model.new_bool_var(f"x[{name},{s.name}]") for s in options]
            model.add_exactly_one(variables)
            choice.update({(name, index): var for index, var in enumerate(variables)})
        return choice

    def _add_edge_linearisation(self, model, edges, strategies, choice):
        """e[u,v,a,b] marginals equal the strategy choices at both ends (exact linearisation)."""
        edge_vars = {}
        for source, target in edges:
            out_states = {s.output for s in strategies[source]}
            in_states = {s.inputs for s in strategies[target]}
            pair = {(a, b): model.new_bool_var(f"e[{source},{target},{a.name},{b.name}]")
                    for a in out_states for b in in_states if (a, b) in _REALISABLE}
            for a in out_states:
                model.add(sum(pair[(a, b)] for b in in_states if (a, b) in pair) ==
                          sum(choice[(source, k)] for k, s in enumerate(strategies[source]) if s.output == a))
            for b in in_states:
                model.add(sum(pair[(a, b)] for a in out_states if (a, b) in pair) ==
                          sum(choice[(target, k)] for k, s in enumerate(strategies[target]) if s.inputs == b))
            edge_vars.update({(source, target, a, b): var for (a, b), var in pair.items()})
        return edge_vars

    def _add_gathered_outputs(self, model, edge_vars, by_name):
        """Consumers of a gathered module's ops read them replicated: the all-gather sits at the
        module's output, as codegen places it, not further down the graph."""
        for (source, _, _, state_in), var in edge_vars.items():
            if by_name[source].module in self.gathered_modules and state_in != State.R:
                model.add(var == 0)

    def _add_column_shards_stay_in_region(self, model, edge_vars, by_name):
        """A split module's shards reach only ops of the module around it (its region): codegen
        gathers a column-parallel output at the module's boundary unless a row-parallel sibling
        pairs it, so shards never reach the layer beyond (a residual branch's dropout). Without
        this the ILP priced an output projection column-parallel with its dropout on shards and
        one gather after it, which no code runs, and the rounds that then gathered every unpaired
        column left the whole attention replicated."""
        for (source, target, state_out, state_in), var in edge_vars.items():
            module = by_name[source].module
            if state_out != State.S or state_in != State.S or module not in self.index.split_modules:
                continue
            region = module.rpartition(".")[0]
            reader = by_name[target].module or ""
            if region and not inside(reader, region):
                model.add(var == 0)

    def _add_backward_all_reduce(self, model, edges, strategies, choice, by_name):
        """One all-reduce per tensor (views resolved to the viewed tensor) whose consumers include
        a column-parallel op: their partial input gradients are summed locally first."""
        consumers = defaultdict(list)
        for source, target in edges:
            consumers[_view_root(source, by_name)].append(target)
        result = {}
        for source, targets in consumers.items():
            splitting = [choice[(t, k)] for t in targets for k, s in enumerate(strategies[t]) if s.splits_input]
            if not splitting:
                continue
            var = model.new_bool_var(f"g[{source}]")
            for x in splitting:
                model.add_implication(x, var)
            result[source] = var
        return result

    def _add_layer_outputs_replicated(self, model, ops, strategies, choice):
        """Tensors that leave the layer, and the loss, must be replicated."""
        consumers_outside = self._consumed_outside(ops)
        for op in ops:
            if op.name in consumers_outside or op.output_shapes == [[]]:
                for k, strategy in enumerate(strategies[op.name]):
                    if strategy.output != State.R:
                        model.add(choice[(op.name, k)] == 0)

    def _head_norm_modules(self, ops: list["OpProfile"]) -> dict[str, list[str]]:
        """Per-head norm module -> its reductions offered head_norm, in trace order."""
        by_module: dict[str, list[str]] = defaultdict(list)
        for op in ops:
            if op.name in self.head_norms and self.tp > 1 and op.module is not None:
                by_module[op.module].append(op.name)
        return by_module

    def _add_head_norms_whole(self, model, norms: dict[str, list[str]], strategies, choice):
        """A per-head norm module's reductions run alike: its style covers the whole module."""
        for names in norms.values():
            for other in names[1:]:
                model.add(_head_norm_choice(names[0], strategies, choice)
                          == _head_norm_choice(other, strategies, choice))

    def _head_norm_gradients(self, op: "OpProfile", norms: dict[str, list[str]]) -> tuple[float, ...]:
        """Bytes of the gradients a head_norm module all-reduces, counted at its first reduction."""
        return self.head_norms[op.name] if op.module is not None and norms[op.module][0] == op.name else ()

    # -- graph reading -----------------------------------------------------------------------

    def _strategies(self, op: "OpProfile", by_name: dict[str, "OpProfile"],
                    head_norm_modules: frozenset[str] = frozenset()) -> list[Strategy]:
        """What ``op`` may run as; ``head_norm_modules``: the layer's per-head norms (`_head_norm_modules`)."""
        options = self._candidate_strategies(op, by_name, head_norm_modules)
        # Activations from other layers arrive replicated and cannot be re-sharded in place.
        if any(name not in by_name and not self._is_param(name) for name in op.inputs):
            options = [s for s in options if s.inputs == State.R]
        return options

    def _candidate_strategies(self, op: "OpProfile", by_name: dict[str, "OpProfile"],
                              head_norm_modules: frozenset[str]) -> list[Strategy]:
        activation_inputs = [name for name in op.inputs if name in by_name or not self._is_param(name)]
        # A product of two activations (attention scores, the weighted values) reads no weight
        # even where a constant joins it (a causal mask added by the same baddbmm).
        has_param = any(self._is_param(name) for name in op.inputs) and not (
            op.op_class == "gemm" and len(activation_inputs) >= 2
            and not any(name in self.index.trainable for name in op.inputs))
        if has_param and op.module in self.replicated_modules and \
                (op.op_class == "gemm" or "embedding" in op.target and "backward" not in op.target):
            return [_REPLICATE]
        if op.op_class == "gemm" and has_param and op.module in self.kv_group_modules and self.tp > 1:
            return [_REPLICATE, _KV_GROUP]
        if op.op_class == "gemm" and has_param and self.tp > 1:
            return [_REPLICATE, _ROWWISE] if op.module in self.not_colwise else [_REPLICATE, _COLWISE, _ROWWISE]
        if "embedding" in op.target and "backward" not in op.target and has_param and self.tp > 1:
            return [_REPLICATE, _VOCAB, _HIDDEN]
        if not activation_inputs or self.tp == 1:
            return [_ALL_R]
        if draws_random(op):
            return [_ALL_R] if self.whole_draws else [_ALL_R, _ALL_S]
        if _reads_shape_only(op):
            return [_ALL_R, _ALL_S, _SHAPE_OF_PARTIAL]
        if any(word in op.target for word in _LOSS_TARGETS):
            return [_ALL_R, _LOSS_PARALLEL] if self._feeds_nll_only(op, by_name) else [_ALL_R]
        if op.name in self.head_norms:
            return [_ALL_R, _HEAD_NORM]
        if self._normalises_scores(op, by_name):
            return [_ALL_R, _ALL_S]
        if self._reads_unsplit_parameter(op, head_norm_modules):
            return [_ALL_R]
        if op.op_class in ("reduction", "norm") or unsplittable(op):
            return [_ALL_R]
        if op.op_class == "view":
            return [_ALL_R, _ALL_S, _VIEW_P]
        return [_ALL_R, _ALL_S]

    def _normalises_scores(self, op: "OpProfile", by_name: dict[str, "OpProfile"]) -> bool:
        """Whether ``op`` is a softmax of attention scores: its input comes, through element-wise
        ops and views, from a product of two activations (a batched matmul of queries and keys).
        Sharded, such a product is split along a batch dim (the heads: both operands carry it),
        and a softmax over queries or keys stays inside each head, so it may run on the rank's
        heads, as a fused attention kernel does."""
        if _packet(op) != "_softmax" or len(op.inputs) != 1:
            return False
        name = op.inputs[0]
        while name in by_name and by_name[name].op_class in ("view", "elementwise"):
            source = by_name[name]
            activations = [inp for inp in source.inputs if inp in by_name]
            if len(activations) != 1:
                return False
            name = activations[0]
        producer = by_name.get(name)
        return (producer is not None and producer.op_class == "gemm"
                and sum(inp in by_name for inp in producer.inputs) >= 2
                and not any(inp in self.index.trainable for inp in producer.inputs))

    def _reads_unsplit_parameter(self, op: "OpProfile", head_norm_modules: frozenset[str]) -> bool:
        """Whether ``op`` computes with a parameter no split style shards: xIELU's alpha_p, a
        layer scale. On a rank's shard of the activations it would run on a whole, plain copy of
        the parameter and leave that rank's share of its gradient, never summed over the group
        (a column-split module's own bias, added beside its GEMM, is sharded with it; a per-head
        norm's weight runs on head shards only under its head_norm style, which sums its gradient)."""
        owners = {fqn.rpartition(".")[0] for name in op.inputs for fqn in self.index.trainable.get(name, ())}
        return bool(owners - ({op.module} & (self.index.split_modules | head_norm_modules)))

    @staticmethod
    def _feeds_nll_only(op: "OpProfile", by_name: dict[str, "OpProfile"]) -> bool:
        """Whether a loss op can take vocabulary-sharded logits: torch's loss parallelism covers
        log-softmax only into ``nll_loss`` (cross-entropy), not a CTC loss or a KL divergence."""
        if "_log_softmax" not in op.target:
            return True
        consumers = [other for other in by_name.values() if op.name in other.inputs and other.phase != "backward"
                     and "detach" not in other.target]  # a detach keeps it for backward
        return bool(consumers) and all("nll_loss" in other.target for other in consumers)

    def _edges(self, ops, by_name) -> list[tuple[str, str]]:
        """Activation edges inside the layer (inputs from other layers arrive replicated)."""
        return [(source, op.name) for op in ops for source in dict.fromkeys(op.inputs) if source in by_name]

    def _consumed_outside(self, ops) -> set[str]:
        layer = ops[0].layer if ops else None
        return {op.name for op in ops if self.index.forward_readers.get(op.name, set()) - {layer}}

    def _is_param(self, name: str) -> bool:
        return name in self._params


    def _backward_ratio(self, layer: str) -> dict[str | None, float]:
        """Per module (and for the whole layer under key None): backward time / forward time."""
        forward: dict[str | None, float] = defaultdict(float)
        backward: dict[str | None, float] = defaultdict(float)
        for op in self.index.by_layer.get(layer, []):
            target = forward if op.phase == "forward" else backward
            seconds = self.costs.op_time_s(op)
            target[op.module] += seconds
            target[None] += seconds
        ratio = {module: backward[module] / forward[module] for module in forward if forward[module] > 0}
        ratio.setdefault(None, 2.0)
        return ratio

    # -- costs ---------------------------------------------------------------------------------

    def _bytes(self, op: "OpProfile") -> int:
        return activation_bytes(op)

    def _loss_parallel_bytes(self, op: "OpProfile") -> float:
        shape = op.output_shapes[0] if op.output_shapes else [1]
        rows = 1
        for dim in shape[:-1]:
            rows *= dim
        return 4.0 * rows

    def _reshard_s(self, state_out: State, state_in: State, source: "OpProfile") -> float:
        """Forward + backward time to turn `state_out` into `state_in` for one tensor."""
        if state_out == state_in:
            return 0.0
        full = self._bytes(source)  # profiled tensors are unsharded: this is the full size
        if (state_out, state_in) == (State.S, State.R):
            return self.costs.all_gather_s(full)
        if (state_out, state_in) == (State.P, State.R):
            return self.costs.all_reduce_s(full)
        raise ValueError(f"no realisable resharding {state_out.name}->{state_in.name}")

    def _read_solution(self, layer, solver, status, ops, strategies, choice, compute_terms, edge_vars,
                       all_reduce_vars, by_name) -> IntraOpSolution:
        op_strategy, module_style = {}, {}
        compute = 0.0
        for op in ops:
            for k, strategy in enumerate(strategies[op.name]):
                if solver.value(choice[(op.name, k)]):
                    op_strategy[op.name] = strategy.name
                    compute += compute_terms[(op.name, k)]
                    if strategy.style is not None and op.module is not None:
                        module_style[op.module] = strategy.style
        comm = 0.0
        events: list[tuple[str, str, float]] = []
        for (source, target, a, b), var in edge_vars.items():
            if solver.value(var) and a != b:
                seconds = self._reshard_s(a, b, by_name[source])
                comm += seconds
                events.append((f"{a.name}->{b.name}", source, self._bytes(by_name[source])))
        for source, var in all_reduce_vars.items():
            if solver.value(var):
                comm += self.costs.all_reduce_s(self._bytes(by_name[source]))
                events.append(("backward all-reduce", source, self._bytes(by_name[source])))
        for op in ops:
            extra = strategies[op.name][_chosen(solver, choice, op.name, strategies)].extra_comm
            if extra == "loss_parallel":
                # Priced with the op's compute (its strategy's cost); listed so it is counted.
                events += [("loss-parallel all-reduce", op.name, self._loss_parallel_bytes(op))] * 3
            elif extra == "kv_group":
                for nbytes in self.kv_group_modules[op.module][1]:
                    events += [("kv-group weight all-gather", op.name, nbytes),
                               ("kv-group gradient reduce-scatter", op.name, nbytes)]
        return IntraOpSolution(layer=layer, tp=self.tp, op_strategy=op_strategy, module_style=module_style,
                               compute_s=compute, comm_s=comm, comm_events=events,
                               status=solver.status_name(status))


def _head_norm_choice(name: str, strategies: dict, choice: dict) -> cp_model.IntVar:
    return next(choice[(name, k)] for k, s in enumerate(strategies[name]) if s.extra_comm == "head_norm")


def _chosen(solver: cp_model.CpSolver, choice: dict, op_name: str, strategies: dict) -> int:
    """Index of the strategy the solution picked for ``op_name``."""
    return next(k for k in range(len(strategies[op_name])) if solver.value(choice[(op_name, k)]))


def activation_bytes(op: "OpProfile") -> int:
    """Bytes of an op's output as the ILP's collectives move it (the whole, unsharded tensor)."""
    return op.bytes_written or op.output_bytes or _shape_bytes(op)


def _view_root(name: str, by_name: dict[str, "OpProfile"]) -> str:
    """Follow view ops back to the tensor they alias (within the layer)."""
    while name in by_name and by_name[name].op_class == "view" and by_name[name].inputs:
        source = by_name[name].inputs[0]
        if source not in by_name:
            break
        name = source
    return name


def _units(seconds: float) -> int:
    return int(round(seconds * TIME_UNITS_PER_S))


def _shape_bytes(op: "OpProfile") -> int:
    total = 0
    for shape in op.output_shapes:
        count = 1
        for dim in shape:
            count *= dim
        total += 2 * count
    return total
