"""The cost model's operator-wise TP splitter, backed by the intra-op ILP.

`cost_models` prices a layer under tensor parallelism through a `TPSplitter`; this one solves
`IntraOpSolver` for the layer kind, TP degree and TP group placement, and reads off which ops
run sharded (their compute divides by t), the collectives the split needs, and which saved
activations and parameters are sharded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.model_profile import inside, inside_any
from autopar.solver.intra_op import (IntraOpSolution, IntraOpSolver, OpIndex, Style, activation_bytes,
                                     draws_random)
from autopar.solver.tp_head_norms import head_norm_reductions
from autopar.solver.tp_kv_groups import KVGroups, attention_producers, kv_groups, parameter_bytes
from autopar.solver.tp_legality import IllegalSplit, TPLegality, illegal_json, illegal_of
from cost_models.weights import selective_reruns
from cost_models.collectives import Collective, collective_time_s
from cost_models.compute import compute_dtype, compute_of_ops, op_roofline_s, op_time_s
from cost_models.hardware import GPUSpec
from cost_models.memory import layer_activations
from cost_models.step import TPLayerSplit
from cost_models.topology import GroupPlacement
from cost_models.tp_layout import ModuleTree, SPRole, after_blocks, paired_regions, sp_parts, stack_of

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile, OpProfile
    from cost_models.layer_split import TPSplitter
    from autopar.domain.layout import TrainSpec

_SHARDED = {"colwise", "rowwise", "vocab_parallel", "hidden_parallel", "S", "loss_parallel", "head_norm"}
_SHARDED_OUTPUT = {"colwise", "hidden_parallel", "S", "loss_parallel", "head_norm"}  # saved outputs divide by t
_PARTIAL_OUTPUT = {"rowwise", "vocab_parallel"}  # partial sums, reduced afterwards
_WHOLE = {"replicate", "head_norm"}  # styles that keep every parameter whole
_COLLECTIVE_OF_EVENT = {"P->R": Collective.ALL_REDUCE, "S->R": Collective.ALL_GATHER,
                        "backward all-reduce": Collective.ALL_REDUCE,
                        "kv-group weight all-gather": Collective.ALL_GATHER,
                        "kv-group gradient reduce-scatter": Collective.REDUCE_SCATTER,
                        "loss-parallel all-reduce": Collective.ALL_REDUCE}


class _GroupCosts:
    """TPCosts for the ILP: roofline op times and collectives on the TP group."""

    def __init__(self, gpu: GPUSpec, dtype: str, group: GroupPlacement):
        self.gpu, self.dtype, self.group = gpu, dtype, group

    def op_time_s(self, op) -> float:
        return op_time_s(op, self.gpu, self.dtype)

    def all_reduce_s(self, nbytes: float) -> float:
        return collective_time_s(Collective.ALL_REDUCE, nbytes, self.group)

    def all_gather_s(self, nbytes: float) -> float:
        return collective_time_s(Collective.ALL_GATHER, nbytes, self.group)

    def reduce_scatter_s(self, nbytes: float) -> float:
        return collective_time_s(Collective.REDUCE_SCATTER, nbytes, self.group)


# ModelProfile.findings' entry of the ILP's proven splits: (layer, tp, dtype, what selective
# recomputation reruns, whether draws stay whole, the tp group's placement, the GPU) -> the
# solution and the splits found illegal on the way, so that a plan from a kept profile solves
# no layer twice (autopar.profile_cache keeps the findings beside the profile).
SOLUTIONS = "tp_solutions"


class ILPSplitter:
    """TPSplitter for cost_models.step.PlanPricer; ``selective_runtime``: the pricer's
    (`TrainSpec.selective_runtime`: which products selective recomputation reruns)."""

    def __init__(self, profile: "ModelProfile", time_limit_s: float = 10.0, selective_runtime: str = "autopar"):
        self.profile = profile
        self.time_limit_s = time_limit_s
        self.dtype = compute_dtype(profile.precision)
        self.index = OpIndex.of(profile)
        self.parameter_derived = self.index.derived
        self.selective_runtime = selective_runtime
        self.rerun_products = selective_reruns(profile, selective_runtime, (self.index.derived, self.index.trainable))
        self.solutions: dict[tuple[str, int], dict[str, str]] = {}
        # (layer, tp) -> (op target, module) of ops no split strategy covers, run replicated
        self.replicated: dict[tuple[str, int], list[tuple[str, str]]] = {}
        self._tied_readers = _tied_readers(profile)
        self._styles: dict[tuple, dict[str, str]] = {}
        self.tree = ModuleTree.of_profile(profile)
        self.legality = TPLegality(profile)
        # (layer, tp) -> module -> why its split cannot run (found before or while solving)
        self.illegal: dict[tuple[str, int], dict[str, IllegalSplit]] = {}
        # (layer, tp) whose loss takes the head's vocabulary-sharded output (loss parallel): only
        # there may codegen keep the head's output a DTensor (CLIP's text_projection feeds a matmul)
        self.loss_parallel: set[tuple[str, int]] = set()
        # (layer, tp) -> its forward ops that run sharded (autopar.solver.tp_coverage's FLOPs)
        self.sharded_ops: dict[tuple[str, int], set[str]] = {}
        # (layer, tp) -> paired regions of its solution that keep DTensor activations (their code
        # views by global sizes: autopar.solver.tp_global_shapes)
        self.dtensor_regions: dict[tuple[str, int], set[str]] = {}
        # (layer, tp) -> paired regions drawing random numbers on the rank's shards (their
        # generators seeded per rank in the generated code: RankRandomNumbers)
        self.random_regions: dict[tuple[str, int], set[str]] = {}
        # (layer, tp) solved with random draws on whole activations: a region of its first
        # solution both kept DTensor activations and drew on shards (see `split`)
        self._whole_draws: set[tuple[str, int]] = set()
        # (layer, tp) -> fused projections of its solution split as their parts (column-parallel in
        # a paired region): FQN -> the parts' global sizes (autopar.solver.tp_fused)
        self.fused_parts: dict[tuple[str, int], dict[str, list[int]]] = {}
        # (layer, tp) -> fused projections of its solution computed by key/value group -> the
        # indices of their parts each rank computes for its group (autopar.solver.tp_kv_groups)
        self.grouped_parts: dict[tuple[str, int], dict[str, list[int]]] = {}
        # (layer, tp) -> region -> attribute -> value the generated code sets for its key/value
        # groups (autopar.solver.tp_legality's region_attributes)
        self.region_attributes: dict[tuple[str, int], dict[str, dict[str, int]]] = {}
        # tp -> the key/value projections computed by groups at that degree (None: no such attention)
        self.kv_groups: dict[int, KVGroups | None] = {}
        # reductions of per-head norms that may run on head shards (autopar.solver.tp_head_norms)
        self.head_norms = head_norm_reductions(profile)
        self._attention_inputs: set[str] | None = None  # modules computing an attention's inputs, found once

    @classmethod
    def for_training(cls, profile: "ModelProfile", train: "TrainSpec") -> "ILPSplitter":
        """The splitter a pricer of `train` needs: its selective recomputation reruns what
        `train.selective_runtime` reruns."""
        return cls(profile, selective_runtime=train.selective_runtime)

    def kv_group_modules(self, layer_name: str, tp: int) -> dict[str, tuple[float, tuple[float, ...]]]:
        """The layer's key/value projections offered the kv_group style at ``tp`` -> (how many
        times less work each rank does, bytes of each parameter's gathered rows: gathered each
        forward, their gradient reduce-scattered). A fused projection computing keys or values
        among its parts (Phi-3's qkv_proj) is one of them: its query part split by tp."""
        groups = self.groups_of(layer_name, tp)
        if groups is None:
            return {}
        return {module: (groups.work_divisor(module), parameter_bytes(self.profile, module,
                                                                      share=groups.gathered_share(module)))
                for module in groups.modules if inside(module, layer_name)}

    def groups_of(self, layer_name: str, tp: int) -> KVGroups | None:
        """The key/value groups at ``tp``, with the layer's fused projections among them."""
        if tp not in self.kv_groups:
            self.kv_groups[tp] = kv_groups(self.profile, tp)
        groups = self.kv_groups[tp]
        return groups.with_fused(self.legality.fused_parts(layer_name, tp)) if groups is not None else None

    def _solve(self, layer_name: str, tp: int, group: GroupPlacement, gpu: GPUSpec) -> IntraOpSolution:
        """The ILP's split of the layer among splits codegen runs as priced: the class and graph
        rules first, then each solution's column-parallel modules outside a paired region gathered
        at their output (`_unpaired_columns`), then its split regions probed and, where one fails,
        solved again without it. Key/value projections computed by group left outside a paired
        region are either ruled out, or kept with their region's output projections offered no
        column split (so that it pairs): the cheaper of the two."""
        key = (layer_name, tp)
        kept_key = repr((layer_name, tp, self.dtype, self.selective_runtime, key in self._whole_draws, group,
                         gpu.signature))
        kept = self.profile.findings.get(SOLUTIONS, {})
        if kept_key in kept:
            self.illegal[key] = illegal_of(kept[kept_key]["illegal"])
            return _solution_of(kept[kept_key], layer_name, tp)
        illegal = self.illegal.setdefault(key, dict(self.legality.static(layer_name, tp)))
        solution, self.illegal[key] = self._solve_under(layer_name, tp, group, gpu, illegal, frozenset())
        if solution.status == "OPTIMAL" and not self.legality.build_failed():
            # Proven optimal on rules that all ran: the same answer for every later plan of the
            # same profile, priced alike (a solve stopped by its time limit is asked again).
            self.profile.findings.setdefault(SOLUTIONS, {})[kept_key] = {
                **_solution_json(solution), "illegal": illegal_json(self.illegal[key])}
        return solution

    def _solve_under(self, layer_name: str, tp: int, group: GroupPlacement, gpu: GPUSpec,
                     illegal: dict[str, IllegalSplit], not_colwise: frozenset[str]
                     ) -> tuple[IntraOpSolution, dict[str, IllegalSplit]]:
        """`_solve` with ``illegal`` modules replicated and ``not_colwise`` ones offered no column
        split: (the solution, the modules found illegal on the way)."""
        illegal = dict(illegal)
        gathered: frozenset[str] = frozenset()
        kv_modules = self.kv_group_modules(layer_name, tp)
        while True:
            solver = IntraOpSolver(self.profile, _GroupCosts(gpu, self.dtype, group), tp, self.time_limit_s,
                                   replicated_modules=frozenset(illegal), gathered_modules=gathered,
                                   index=self.index, kv_group_modules=kv_modules, head_norms=self.head_norms,
                                   not_colwise=not_colwise, whole_draws=(layer_name, tp) in self._whole_draws)
            solution = solver.solve(layer_name)
            if tp <= 1:
                return solution, illegal
            unpaired = self._unpaired_columns(solution) - gathered
            lone_groups = {m for m in unpaired if solution.module_style[m].value == "kv_group"}
            if lone_groups:
                # A key/value head per group feeds the attention of its query heads only: outside
                # a paired region nothing would read it (codegen has no gathered variant).
                outputs = self._output_projections(lone_groups, solution) - not_colwise
                paired = self._solve_under(layer_name, tp, group, gpu, illegal, not_colwise | outputs) \
                    if outputs else None
                illegal.update({m: IllegalSplit(m, "key/value groups", f"{m} computes one key/value head per "
                                                "group, which only a paired region's attention reads")
                                for m in lone_groups})
                alone = self._solve_under(layer_name, tp, group, gpu, illegal, not_colwise)
                return min((found for found in (paired, alone) if found is not None), key=lambda f: f[0].time_s)
            if unpaired:
                gathered |= unpaired
                continue
            failed = self.legality.probe(layer_name, tp, {m: s.value for m, s in solution.module_style.items()})
            if not failed or set(failed) <= set(illegal):
                return solution, illegal
            unpair = {m for m in failed if m not in illegal and solution.module_style.get(m) is not None
                      and solution.module_style[m].value == "colwise"} - gathered
            if unpair:
                # A region whose code fails on a rank's share still runs with its columns gathered
                # at once (whole activations inside, as codegen gathers an unpaired column): tried
                # before its linears are ruled out (BLOOM's attention, paired since its scores'
                # product reads no weight, fails on shards and ran whole; gathered, it splits).
                gathered |= unpair
                continue
            illegal.update(failed)

    def _output_projections(self, lone_groups: set[str], solution: IntraOpSolution) -> frozenset[str]:
        """The column-parallel linears of the lone key/value groups' regions that compute none of
        an attention's inputs (o_proj): what would pair the region if split by rows."""
        if self._attention_inputs is None:
            self._attention_inputs = attention_producers(self.profile)
        regions = {module.rpartition(".")[0] for module in lone_groups}
        return frozenset(module for module, style in solution.module_style.items()
                         if style.value == "colwise" and module.rpartition(".")[0] in regions
                         and module not in self._attention_inputs)

    def _unpaired_columns(self, solution: IntraOpSolution) -> frozenset[str]:
        """Column-parallel modules outside a paired region (autopar.codegen.tp_plan's rule, from
        cost_models.tp_layout): codegen gathers each one's output at once, so the ILP may not keep
        it sharded further (Llama's q, k, v split without o_proj would otherwise be priced with
        one gather after attention on head shards, where codegen gathers three and runs attention
        whole). A head feeding a parallel loss keeps its sharded logits, as codegen does."""
        if "loss_parallel" in solution.op_strategy.values():
            return frozenset()
        styles = {module: style.value for module, style in solution.module_style.items()}
        regions = paired_regions(styles, self.tree.children, self.tree.kind)
        return frozenset(module for module, style in styles.items()
                         if style in ("colwise", "kv_group") and module.rpartition(".")[0] not in regions)

    def split(self, layer_name: str, tp: int, group: GroupPlacement, gpu: GPUSpec) -> TPLayerSplit:
        solution = self._solve(layer_name, tp, group, gpu)
        self.solutions[(layer_name, tp)] = {module: style.value for module, style in solution.module_style.items()}
        self.replicated[(layer_name, tp)] = solution.replicated_ops
        if tp > 1:
            styles = self.solutions[(layer_name, tp)]
            self.dtensor_regions[(layer_name, tp)] = self.legality.dtensor_regions(layer_name, tp, styles)
            self.region_attributes[(layer_name, tp)] = self.legality.region_attributes(layer_name, tp, styles)
            regions = paired_regions(styles, self.tree.children, self.tree.kind)
            self.random_regions[(layer_name, tp)] = _drawing_regions(
                [op for op in self.index.by_layer.get(layer_name, []) if solution.op_strategy.get(op.name) == "S"
                 and draws_random(op)], regions, layer_name)
            if self.random_regions[(layer_name, tp)] & self.dtensor_regions[(layer_name, tp)]:
                # Seeded per rank, a DTensor region's draws would still go through DTensor's own
                # generator offsets, which activation recomputation does not replay: such a
                # region draws on whole activations, as before draws could run on shards.
                self._whole_draws.add((layer_name, tp))
                return self.split(layer_name, tp, group, gpu)
            self.fused_parts[(layer_name, tp)] = {
                module: parts for module, parts in self.legality.fused_parts(layer_name, tp).items()
                if styles.get(module) in ("colwise", "kv_group") and module.rpartition(".")[0] in regions}
            groups = self.groups_of(layer_name, tp)
            self.grouped_parts[(layer_name, tp)] = {
                module: [index for index, grouped in enumerate(groups.grouped(module)) if grouped]
                for module in self.fused_parts[(layer_name, tp)] if styles[module] == "kv_group"} if groups else {}
        if "loss_parallel" in solution.op_strategy.values():
            self.loss_parallel.add((layer_name, tp))
        self._styles[(layer_name, tp, group, gpu.signature)] = self.solutions[(layer_name, tp)]
        ops = list(self.index.by_layer.get(layer_name, []))
        sharded_ops = {name for name, strategy in solution.op_strategy.items() if strategy in _SHARDED}
        self.sharded_ops[(layer_name, tp)] = sharded_ops
        sharded_modules = {op.module for op in ops if op.name in sharded_ops and op.phase == "forward"}
        # Key/value projections computing their group's head: work divided by the key/value heads
        kv_modules = self.kv_group_modules(layer_name, tp) if tp > 1 else {}
        by_groups = {module: kv_modules[module][0] for module, style in solution.module_style.items()
                     if style.value == "kv_group"}

        def sharded(op) -> bool:
            return op.name in sharded_ops if op.phase == "forward" else op.module in sharded_modules

        def divisor(op) -> float:
            return tp if sharded(op) else by_groups.get(op.module, 1)

        forward = [op for op in ops if op.phase == "forward" and op.op_class != "view"]
        backward = [op for op in ops if op.phase == "backward" and op.op_class != "view"]

        def seconds(selected) -> float:
            return sum(op_roofline_s(op, gpu, self.dtype) / divisor(op) for op in selected)

        compute = compute_of_ops(forward, backward, seconds, self.rerun_products)
        layer = self.profile.layer(layer_name)
        by_name = {op.name: op for op in ops}
        strategy = solution.op_strategy
        colwise = {op.name for op in forward if strategy.get(op.name) == "colwise"}
        acts = layer_activations(layer, forward,
                                 sharded_outputs={op.name for op in forward
                                                  if strategy.get(op.name) in _SHARDED_OUTPUT},
                                 row_parallel={op.name for op in forward if strategy.get(op.name) in _PARTIAL_OUTPUT},
                                 tp=tp, gathered=_column_inputs(by_name, colwise, self.parameter_derived),
                                 rerun_products=self.rerun_products)
        params = layer.param_count
        split_params = sum(_split_params(self.profile, module, style.value)
                           for module, style in solution.module_style.items() if style.value not in _WHOLE)
        tied_params, tied_comm = self._tied_splits(layer, ops, solution.module_style, tp, group, gpu)
        split_params += tied_params
        styles = {module: style.value for module, style in solution.module_style.items()}
        issued = issued_collectives(solution.comm_events, by_name, strategy, tied_comm,
                                    self._split_regions(layer_name, styles))
        sp = sp_parts(self.profile, self.tree, layer_name, styles, [op for op in forward if not sharded(op)],
                      [op for op in backward if not sharded(op)], lambda op: op_roofline_s(op, gpu, self.dtype))
        return TPLayerSplit(
            compute=compute,
            replicated_forward_s=sum(op_roofline_s(op, gpu, self.dtype) / divisor(op) for op in forward
                                     if not sharded(op)),
            replicated_backward_s=sum(op_roofline_s(op, gpu, self.dtype) / divisor(op) for op in backward
                                      if not sharded(op)),
            comm=issued.without_sp, forward_comm=issued.forward_without_sp,
            comm_under_sp=issued.under_sp, forward_comm_under_sp=issued.forward_under_sp,
            rerun_comm=issued.rerun_without_sp, rerun_comm_under_sp=issued.rerun_under_sp,
            tp_sharded_activation_fraction=acts.saved_sharded_bytes / acts.saved_bytes if acts.saved_bytes else 0.0,
            tp_sharded_param_fraction=min(1.0, split_params / params) if params else 0.0,
            styles=styles, activations=acts, sp=sp)


    def _split_regions(self, layer_name: str, styles: dict[str, str]) -> set[str]:
        """The layer's children that run as a split region under sequence parallelism (a block's
        attention or MLP with its matmuls paired), as codegen's styles make them."""
        containers = self.profile.block_containers
        if layer_name in after_blocks([layer.name for layer in self.profile.layers], containers):
            return {layer_name}  # a split head reads the sequence-sharded stream (codegen: Shard(1) input)
        if stack_of(layer_name, containers) is None:
            return set()
        return {child for child, role in self.tree.roles(layer_name, styles).items() if role == SPRole.SPLIT_REGION}

    def _tied_splits(self, layer: Any, ops: list, own_styles: dict, tp: int, group: GroupPlacement,
                     gpu: GPUSpec) -> tuple[int, list[tuple[str, float]]]:
        """Parameters of ``layer`` its own solution replicates but a GEMM of another layer reads
        and splits (a GPT head tied to the token embedding), and the collectives that costs: the
        generated code shards a tied weight as its linear user does
        (autopar.codegen.tp_plan.harmonise_tied), so the embedding reading it runs split too,
        vocabulary-parallel under a column-parallel head (partial sums: one all-reduce of its
        output in forward), hidden-parallel under a row-parallel one (one all-gather)."""
        count, comm = 0, []
        for name in layer.param_names:
            module = name.rpartition(".")[0]
            reader = self._tied_readers.get(name)
            if reader is None or (module in own_styles and own_styles[module].value != "replicate"):
                continue
            other_layer, other_module = reader
            key = (other_layer, tp, group, gpu.signature)
            if key not in self._styles:
                solution = self._solve(other_layer, tp, group, gpu)
                self._styles[key] = {m: st.value for m, st in solution.module_style.items()}
            style = self._styles[key].get(other_module)
            if style not in ("colwise", "rowwise"):
                continue
            count += math.prod(self.profile.param_shapes.get(name, [0]))
            collective = Collective.ALL_REDUCE if style == "colwise" else Collective.ALL_GATHER
            for op in ops:
                if op.phase == "forward" and op.module == module and "embedding" in op.target:
                    comm.append((collective.value, float(activation_bytes(op))))
        return count, comm


@dataclass(frozen=True)
class IssuedCollectives:
    """A layer's split collectives per micro-batch as the generated styles issue them, forward
    first: without sequence parallelism, and with it (where a split region's all-reduce pair
    runs as gathers and reduce-scatters of the sequence), and of the forward ones those full
    recomputation's re-run forward issues again (`_recomputed_forward`)."""

    without_sp: tuple[tuple[str, float], ...]
    forward_without_sp: int
    under_sp: tuple[tuple[str, float], ...]
    forward_under_sp: int
    rerun_without_sp: tuple[tuple[str, float], ...] = ()
    rerun_under_sp: tuple[tuple[str, float], ...] = ()


def _solution_json(solution: IntraOpSolution) -> dict[str, Any]:
    """What a kept solution holds (ModelProfile.findings[SOLUTIONS]), as JSON."""
    return {"op_strategy": dict(solution.op_strategy),
            "module_style": {module: style.value for module, style in solution.module_style.items()},
            "compute_s": solution.compute_s, "comm_s": solution.comm_s,
            "comm_events": [list(event) for event in solution.comm_events],
            "replicated_ops": [list(op) for op in solution.replicated_ops]}


def _solution_of(kept: dict[str, Any], layer_name: str, tp: int) -> IntraOpSolution:
    """The solution `_solution_json` kept."""
    return IntraOpSolution(layer=layer_name, tp=tp, op_strategy=dict(kept["op_strategy"]),
                           module_style={module: Style(style) for module, style in kept["module_style"].items()},
                           compute_s=kept["compute_s"], comm_s=kept["comm_s"],
                           comm_events=[tuple(event) for event in kept["comm_events"]],
                           replicated_ops=[tuple(op) for op in kept["replicated_ops"]])


def _readers_through_views(source: str, by_name: dict[str, Any]) -> list[Any]:
    """The ops reading ``source``'s output, directly or through views of it."""
    found, frontier, seen = [], [source], {source}
    while frontier:
        name = frontier.pop()
        for op in by_name.values():
            if name in op.inputs and op.name not in seen:
                seen.add(op.name)
                if op.op_class == "view":
                    frontier.append(op.name)
                else:
                    found.append(op)
    return found


def _producer_through_views(source: str, by_name: dict[str, Any]) -> Any:
    """The op whose output ``source`` views (None: it comes from another layer)."""
    op = by_name.get(source)
    while op is not None and op.op_class == "view" and len(op.inputs) >= 1:
        op = by_name.get(op.inputs[0])
    return op


def issued_collectives(events: list[tuple[str, str, int]] | list[tuple[str, str, float]], by_name: dict[str, Any],
                       strategy: dict[str, str],
                       tied: list[tuple[str, float]], regions: set[str]) -> IssuedCollectives:
    """The ILP's resharding events as torch's styles run them.

    Without SP: a row-parallel output's P->R is a forward all-reduce, a gathered column-parallel
    output's S->R a forward all-gather (its gradient is sliced locally), loss parallelism's three
    all-reduces and a tied embedding's reduction are forward, and a shared input of
    column-parallel matmuls all-reduces its gradient once in backward (codegen hands the region
    its input as one replicated DTensor). Under SP, inside a split region: the row-parallel
    output is reduce-scattered onto sequence shards (backward: its gradient all-gathered), and
    the region's input is all-gathered (backward: its gradient reduce-scattered). A
    column-parallel module reading anything else (outside a region, or a tensor made inside
    one) gets a plain tensor and all-reduces its own input gradient."""
    forward, backward, forward_sp, backward_sp = [], [], [], []
    rerun, rerun_sp = [], []  # the forward ones full recomputation issues again
    recomputed = _recomputed_forward(by_name)
    for kind, source, nbytes in events:
        collective = _COLLECTIVE_OF_EVENT.get(kind)
        if collective is None:
            continue
        item = (collective.value, float(nbytes))
        op = by_name.get(source)
        again = source in recomputed or source not in by_name  # another layer's output: read first
        if kind == "kv-group gradient reduce-scatter":  # in backward, with or without SP
            backward.append(item)
            backward_sp.append(item)
            continue
        if kind == "kv-group weight all-gather":  # in forward, again when recomputed, with or without SP
            forward.append(item)
            forward_sp.append(item)
            rerun += [item] if again else []
            rerun_sp += [item] if again else []
            continue
        if kind == "backward all-reduce":
            readers = [o for o in _readers_through_views(source, by_name)
                       if strategy.get(o.name) in ("colwise", "kv_group")]
            producer = _producer_through_views(source, by_name)
            entering = {o.module for o in readers if inside_any(o.module, regions)
                        and not (producer is not None and inside_any(producer.module, regions))}
            alone = sorted({o.module for o in readers} - entering)
            # Matmuls fed the region's input as one DTensor share a reduction; any other
            # column-parallel module gets a plain tensor and all-reduces its own input gradient.
            backward += [item] * (len(alone) + (1 if entering else 0))
            backward_sp += [item] * len(alone)
            if entering:
                gather = (Collective.ALL_GATHER.value, float(nbytes))
                forward_sp.append(gather)
                rerun_sp += [gather] if again else []
                backward_sp.append((Collective.REDUCE_SCATTER.value, float(nbytes)))
            continue
        forward.append(item)
        rerun += [item] if again else []
        if kind == "P->R" and op is not None and inside_any(op.module, regions):
            forward_sp.append((Collective.REDUCE_SCATTER.value, float(nbytes)))
            rerun_sp += [forward_sp[-1]] if again else []
            backward_sp.append((Collective.ALL_GATHER.value, float(nbytes)))
        else:
            forward_sp.append(item)
            rerun_sp += [item] if again else []
    forward += tied
    forward_sp += tied
    return IssuedCollectives(tuple(forward + backward), len(forward), tuple(forward_sp + backward_sp), len(forward_sp),
                             tuple(rerun + tied), tuple(rerun_sp + tied))


def _recomputed_forward(by_name: dict[str, Any]) -> set[str]:
    """The layer's forward ops that full recomputation runs again: those up to the last forward
    tensor the layer's own backward reads. Non-reentrant checkpointing stops the re-run forward
    there (its early stop), so what follows (a block's last row-parallel output and its
    collective, the residual add) is not run twice; measured: under SP a fully recomputed GPT
    block reduce-scatters 3 times per micro-batch, not 4."""
    forward = [name for name, op in by_name.items() if op.phase == "forward"]
    read = {source for op in by_name.values() if op.phase == "backward" for source in op.inputs}
    last = max((i for i, name in enumerate(forward) if name in read), default=-1)
    return set(forward[:last + 1])



def _tied_readers(profile: "ModelProfile") -> dict[str, tuple[str, str]]:
    """Parameter FQN -> (layer, module) of a forward GEMM reading it from a layer that does not
    own it: the tied parameters and their linear user."""
    owner = {name: layer.name for layer in profile.layers for name in layer.param_names}
    by_name = {op.name: op for op in profile.ops}
    readers: dict[str, tuple[str, str]] = {}
    for op in profile.ops:
        if op.phase != "forward" or op.op_class != "gemm" or op.module is None:
            continue
        for name in profile.params_read(op, by_name):
            if owner.get(name) not in (None, op.layer):
                readers.setdefault(name, (op.layer, op.module))
    return readers


def _column_inputs(ops_by_name: dict[str, "OpProfile"], colwise: set[str], params: set[str]) -> set[str]:
    """The ops (through views) whose outputs column-parallel GEMMs read as activations: under
    sequence parallelism torch all-gathers them and autograd keeps the whole copy."""
    producers = set()
    for name in colwise:
        for source in ops_by_name[name].inputs:
            op = ops_by_name.get(source)
            while op is not None and op.op_class == "view" and len(op.inputs) == 1:
                source, op = op.inputs[0], ops_by_name.get(op.inputs[0])
            if source not in params and source in ops_by_name:
                producers.add(source)
    return producers


def replicated_ops(splitter: TPSplitter | None, tp: int) -> dict[str, list[str]]:
    """Op target -> modules (in every layer, repeats included) where tensor parallelism of degree
    ``tp`` found no split and replicated the op, for the layers the splitter has solved."""
    found: dict[str, list[str]] = {}
    if tp == 1 or not isinstance(splitter, ILPSplitter):  # without TP, or priced without this solver's split
        return found
    for layer in splitter.profile.layers:
        kind = layer.repeat_of or layer.name
        for target, module in splitter.replicated.get((kind, tp), splitter.replicated.get((layer.name, tp), [])):
            name = layer.name + module[len(kind):] if module.startswith(kind) else module
            found.setdefault(target, [])
            if name not in found[target]:
                found[target].append(name)
    return found


def illegal_splits(splitter: ILPSplitter, tp: int) -> list[str]:
    """One line per kind of refused split at degree ``tp`` (the rule, the modules, and what
    decided it for the first of them), for the report."""
    by_kind: dict[str, list[IllegalSplit]] = {}
    for (_, degree), found in splitter.illegal.items():
        if degree == tp:
            for item in found.values():
                by_kind.setdefault(item.kind, []).append(item)
    lines = []
    for kind, items in by_kind.items():
        modules = [item.module for item in items]
        shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        lines.append(f"tensor-parallel split refused ({kind}) for {shown}: {items[0].reason}; they run replicated.")
    return lines


def _split_params(profile: "ModelProfile", module: str, style: str) -> int:
    """Parameters of ``module`` that its style splits: all of them but a row-parallel bias, which
    torch's RowwiseParallel keeps whole on every rank (added once, after the reduction)."""
    return sum(math.prod(shape) for name, shape in profile.param_shapes.items()
               if name.rsplit(".", 1)[0] == module and not (style == "rowwise" and name.endswith(".bias")))


def _drawing_regions(draws: list["OpProfile"], regions: set[str], layer_name: str) -> set[str]:
    """The paired regions holding ``draws`` (random draws the split runs on shards), each the
    innermost region around its op's module. Shards exist only inside paired regions (a column
    output outside one is gathered at once), so every such draw has one."""
    found = set()
    for op in draws:
        module = op.module or layer_name
        while module and module not in regions:
            module = module.rpartition(".")[0]
        if not module:
            raise RuntimeError(f"{op.target} in {op.module} draws random numbers on shards outside a paired region")
        found.add(module)
    return found
