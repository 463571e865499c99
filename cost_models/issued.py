"""The collectives one training step issues, by kind, as the pricer prices them.

`IssuedCollectives` (the pricer's `issued`) holds the counts. Each method counts the calls the
generated module makes in one step (`train_step`: every micro-batch's forward and backward,
gradient synchronisation and the optimizer step) on the ranks at coordinate 0 of every mesh axis
but pp, one rank per pipeline stage, summed over them. A collective counts once per counted rank
taking part (a tied gradient's all-reduce between the first and last stage counts twice); a
point-to-point exchange (`send_recv`) counts once per send and its matching receive on a
counted rank (a stage boundary's activation counts on both of its stages).

    pricer.issued_collectives(plan.layout())   # {'all_gather': 11, 'reduce_scatter': 6, ...}
    pricer.issued.tp_collectives(plan.layout())   # the tensor-parallel group's alone

The counting rules follow codegen (autopar/sections: data_parallel.py, optimizer.py,
gradient_sync.py, pipeline.py, context_parallel.py) and were measured on gloo ranks for every
plan of the equivalence suite (tests/dist/test_collective_counts.py); each rule names what was
measured. What a step issues outside `train_step` (the logged loss's and the peak memory's
all-reduces) is measurement, not training, and is not priced.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import CPStrategy, Recompute
from cost_models.collectives import Algorithm, Collective
from cost_models.compute import ComputeModel
from cost_models.dp_sync import GradientSync
from cost_models.expert_parallel import ExpertFacts, all_to_alls
from cost_models.layer_cost import LayerPrices, cp_passes, tp_issued
from cost_models.layer_split import LayerSplits
from cost_models.placement import LayoutGroups
from cost_models.ranks import PipelineRanks
from cost_models.structure import ModelStructure

if TYPE_CHECKING:
    from autopar.domain.layout import TrainSpec
    from autopar.model_profile import ModelProfile

__all__ = ["Counts", "add", "IssuedCollectives", "cp_passes"]

Counts = dict[str, int]


def add(total: Counts, more: Counts, times: int = 1) -> Counts:
    """``total`` plus ``times`` x ``more``, in place (kinds with a zero count left out)."""
    for kind, count in more.items():
        if count * times:
            total[kind] = total.get(kind, 0) + count * times
    return total


class IssuedCollectives:
    """Counts of the collectives a generated step issues, as the pricer prices them.

    Args:
        profile: the traced model (its parameters' names, for per-head norms).
        train: the training settings (gradient clipping).
        compute: the model's compute prices (layer kinds).
        structure: FSDP units, tied weights, attention, stages and recomputation per layer.
        groups: where a layout's groups sit.
        sync: the data-parallel gradient synchronisation (its buckets).
        experts: the model's MoE layers.
        splits: each layer kind's TP split (what its TP group issues).
        ranks: the reference GPU of a layout's pipeline ranks.
        layer_prices: a layer's parameters on one rank (what fills the gradient buckets).
        recompute_options: the recompute choices a layout's options index.
    """

    def __init__(self, profile: "ModelProfile", train: "TrainSpec", compute: ComputeModel, structure: ModelStructure,
                 groups: LayoutGroups, sync: GradientSync, experts: ExpertFacts, splits: LayerSplits,
                 ranks: PipelineRanks, layer_prices: LayerPrices, recompute_options: tuple[str, ...]):
        self.profile = profile
        self.train = train
        self.compute = compute
        self.structure = structure
        self.groups = groups
        self.sync = sync
        self.experts = experts
        self.splits = splits
        self.ranks = ranks
        self.layer_prices = layer_prices
        self.recompute_options = recompute_options
        self.layers = profile.layers

    def per_step(self, layout: ParallelLayout) -> Counts:
        """Collective -> calls in one step on the counted ranks (see the module docstring): every
        group's (tensor, expert, data, pipeline and context parallel) summed."""
        total: Counts = {}
        for counts in (self.tp_collectives(layout), self.partial_gradient_collectives(layout),
                       self.ep_collectives(layout), self.dp_collectives(layout), self.pp_collectives(layout),
                       self.cp_collectives(layout), self.scalar_collectives(layout)):
            add(total, counts)
        return total

    def tp_collectives(self, layout: ParallelLayout) -> dict[str, int]:
        """Collective -> how many the TP group issues per step under `layout`'s prices: each
        layer's split (forward ones again where fully recomputed) and, under sequence
        parallelism, its boundaries' gathers, times the micro-batches. What a test counts in a
        generated step."""
        if layout.tp == 1:
            return {}
        reference = self.ranks.reference_gpu(layout)
        counts: dict[str, int] = {}
        options = self._layer_options(layout)
        for layer, option in zip(self.layers, options):
            split = self.splits.split(layer.name, layout, reference)
            for op, _ in tp_issued(split, layout, self.recompute_options[option] == Recompute.FULL):
                counts[op] = counts.get(op, 0) + layout.num_micro_batches
        return counts

    def ep_collectives(self, layout: ParallelLayout) -> dict[str, int]:
        """Collective -> how many the expert-parallel groups issue per step under `layout`'s
        prices: each MoE layer's dispatch and combine all-to-alls (cost_models.expert_parallel),
        times the micro-batches. What a test counts in a generated step."""
        if layout.ep == 1:
            return {}
        options = self._layer_options(layout)
        count = sum(all_to_alls(self.recompute_options[option], moe.dropless)
                    for layer, option in zip(self.layers, options) if (moe := self.experts.experts_of(layer.name)))
        return {"all_to_all": count * layout.num_micro_batches} if count else {}

    def scalar_collectives(self, layout: ParallelLayout) -> Counts:
        """Gradient clipping (the module's max_grad_norm > 0): one all-reduce of the squared norm
        over every rank per step (codegen's `clip_gradients`), and a token-level loss's count of
        counted targets (codegen's `TokenCounts.finish`), each counted on each pipeline rank."""
        calls = int(self.train.clip_grad_norm) + int(self.structure.weighs_tokens(layout))
        return {Collective.ALL_REDUCE.value: layout.pp * calls} if calls else {}

    def partial_gradient_collectives(self, layout: ParallelLayout) -> Counts:
        """Gradients that are partial sums over the TP group: under sequence parallelism the
        norms' (they run on each rank's slice of the sequence), and with per-head norms on head
        shards (Qwen3's q_norm and k_norm, ``head_norm``: autopar.solver.tp_head_norms) theirs.
        Codegen's `reduce_partial_gradients` all-reduces each once per step over the TP group
        (measured: GPT's 18 norm weights and biases, Llama's 9 norm weights, and no other
        parameter). Where FSDP reduce-scatters every micro-batch (ZeRO-2/3 outside a pipeline)
        it sums them first, every micro-batch (measured on GPT cp2 x tp2+SP ZeRO-2: 36
        all-reduces at 2 micro-batches)."""
        if layout.tp == 1:
            return {}
        reference = self.ranks.reference_gpu(layout)
        count = sum(len(self.structure.slice_norm_params(layer.name)) if layout.sequence_parallel else 0
                    for layer in self.layers)
        count += sum(self._head_norm_params(self.splits.split(layer.name, layout, reference).styles)
                     for layer in self.layers)
        if layout.zero_stage >= 2 and self.groups.grad_size(layout) > 1 and layout.pp == 1:
            count *= layout.num_micro_batches
        return {Collective.ALL_REDUCE.value: count} if count else {}

    def _head_norm_params(self, styles: dict[str, str]) -> int:
        """Parameters of a layer's modules whose split runs them on head shards."""
        modules = {module for module, style in styles.items() if style == "head_norm"}
        return sum(name.rpartition(".")[0] in modules for name in self.profile.param_shapes) if modules else 0

    def _layer_options(self, layout: ParallelLayout) -> list[int]:
        return self.structure.layer_options(layout, self.recompute_options)

    # -- stages ---------------------------------------------------------------------------------

    def stage_layers(self, layout: ParallelLayout) -> list[list[str]]:
        """Layer names of each (virtual) pipeline stage, in model order."""
        if layout.stages:
            return [list(stage) for stage in layout.stages]
        starts = self.structure.stage_starts(layout) + [len(self.layers)]
        return [[layer.name for layer in self.layers[a:b]] for a, b in zip(starts, starts[1:])]

    # -- data parallelism -----------------------------------------------------------------------

    def dp_collectives(self, layout: ParallelLayout) -> Counts:
        """Collective -> calls per step of the gradient (data- x context-parallel) groups."""
        if layout.dp * layout.cp == 1:
            return {}
        if self._custom_sync(layout):
            return self._custom_sync_collectives(layout)
        total: Counts = {}
        for rank_layers in self._pp_rank_layers(layout):
            for layers in rank_layers:
                add(total, self._fsdp_collectives(layout, *self.structure.fsdp_units(layers)))
            if layout.zero_stage == 1 and layout.dp > 1:
                # ShardedAdamW: one all-gather of the flat parameter vector per pipeline rank and
                # step (measured on dp2 GPT: 1, where 8 per-layer gathers were priced before).
                add(total, {Collective.ALL_GATHER.value: 1})
        return total

    def _pp_rank_layers(self, layout: ParallelLayout) -> list[list[list[str]]]:
        """Per pipeline rank, the layers of each stage it holds (stage j on rank j % pp)."""
        stages = self.stage_layers(layout)
        return [stages[rank::layout.pp] for rank in range(layout.pp)]

    def _fsdp_collectives(self, layout: ParallelLayout, units: list[list[str]], root: list[str]) -> Counts:
        """FSDP2's calls for one stage module: per unit (the root counted like one), measured on
        dp2 GPT (6 units): ZeRO-0/1 one all-reduce per unit, after the last micro-batch's
        backward; ZeRO-2 an all-gather per unit at each micro-batch's forward (parameters are
        resharded after backward) and a reduce-scatter at its backward; ZeRO-3 also gathers
        every unit but the root again for backward (11 all-gathers, 6 reduce-scatters per
        micro-batch). Hybrid sharding adds the replicas' all-reduce after each reduce-scatter.
        Under a pipeline schedule ZeRO-2 gathers and reduce-scatters once per step (the schedule
        keeps parameters gathered and skips the reduction until the last micro-batch's
        backward; measured on cp2 x pp2 GPT and Llama, 6 units over the two stages, 4
        micro-batches: 6 all-gathers and 6 reduce-scatters).
        ZeRO-3 under a pipeline schedule reduce-scatters once per step too, and gathers the root
        once and every other unit at each micro-batch's forward and once more for backward
        (measured on dp2 x tp2 x pp2 interleaved, 2 micro-batches: 7 and 9 all-gathers, 3
        reduce-scatters on the two pipeline ranks; at 2 micro-batches M + 1 and 2M - 1 gathers
        per unit agree: past 2, M + 1 is an assumption, not yet measured)."""
        wrapped = len(units) + (1 if root else 0)
        m = layout.num_micro_batches
        if layout.zero_stage <= 1:
            return {Collective.ALL_REDUCE.value: wrapped}
        if layout.pp > 1:
            gathers = wrapped if layout.zero_stage == 2 else len(units) * (m + 1) + (1 if root else 0)
            return {Collective.ALL_GATHER.value: gathers, Collective.REDUCE_SCATTER.value: wrapped}
        counts = {Collective.ALL_GATHER.value: wrapped * m, Collective.REDUCE_SCATTER.value: wrapped * m}
        if layout.zero_stage == 3:
            counts[Collective.ALL_GATHER.value] += len(units) * m
        if layout.hybrid_shard and self.groups.shard_size(layout) < self.groups.grad_size(layout):
            counts[Collective.ALL_REDUCE.value] = wrapped * m
        return counts

    def _custom_sync(self, layout: ParallelLayout) -> bool:
        """Whether gradients go through gradient_sync.py's exchange instead of FSDP (codegen's
        `custom_gradient_sync`)."""
        return (layout.dp_sync in (Algorithm.HIERARCHICAL, Algorithm.HALVING_DOUBLING, Algorithm.PARAMETER_SERVER)
                and layout.zero_stage <= 1 and layout.dp > 1 and layout.cp == 1)

    def dp_buckets(self, layout: ParallelLayout) -> int:
        """Flat gradient buckets of the generated exchange on one pipeline rank: its fp32
        gradients over the plan's bucket size (consecutive parameters fill a bucket; a bucket
        never splits a parameter, so this is a lower bound when parameters straddle buckets)."""
        reference = self.ranks.reference_gpu(layout)
        total = sum(self.layer_prices.tp_params(layer, self.splits.split(layer.name, layout, reference), layout)
                    for layer in self.layers) * 4 / layout.pp
        return max(1, math.ceil(total / self.sync.bucket_bytes(layout)))

    def _custom_sync_collectives(self, layout: ParallelLayout) -> Counts:
        """gradient_sync.py's calls per bucket on the counted rank (the first of its group):
        hierarchical a reduce-scatter in the node, an all-reduce across nodes and an all-gather
        in the node; halving-doubling 2 log2(n) exchanges; the parameter server (the first
        rank) receives every worker's gradients and sends each the parameters back."""
        n, buckets = layout.dp, self.dp_buckets(layout)
        if layout.dp_sync == Algorithm.PARAMETER_SERVER:
            per_bucket = {Collective.SEND_RECV.value: n - 1}
        elif layout.dp_sync == Algorithm.HALVING_DOUBLING:
            per_bucket = {Collective.SEND_RECV.value: 2 * (n.bit_length() - 1)}
        else:
            per_bucket = {Collective.REDUCE_SCATTER.value: 1, Collective.ALL_REDUCE.value: 1,
                          Collective.ALL_GATHER.value: 1}
        total = add({}, per_bucket, buckets * layout.pp)
        if layout.zero_stage == 1:  # the flat all-gather of ShardedAdamW, as under FSDP
            add(total, {Collective.ALL_GATHER.value: layout.pp})
        return total

    # -- pipeline parallelism -------------------------------------------------------------------

    def pp_collectives(self, layout: ParallelLayout) -> Counts:
        """Point-to-point exchanges per step of the pipeline: every boundary between (virtual)
        stages passes each micro-batch's activation forward and its gradient back, counted on
        both stages. Interleaving multiplies the boundaries (pp x chunks - 1)."""
        if layout.pp == 1:
            return {}
        boundaries = layout.pp * layout.chunks - 1
        counts = {Collective.SEND_RECV.value: 2 * boundaries * layout.num_micro_batches}
        # TiedGradientSync: a weight tied across pipeline ranks (GPT's embedding and head) has its
        # gradient all-reduced once per step on each rank holding a copy (measured: 1 all-reduce
        # on each of pp2 GPT's two ranks, none for Llama's untied head).
        rank_of = {name: index % layout.pp for index, stage in enumerate(self.stage_layers(layout)) for name in stage}
        for reader, owner in self.structure.tied_layers().items():
            ranks = {rank_of[reader], rank_of[owner]}
            if len(ranks) > 1:
                add(counts, {Collective.ALL_REDUCE.value: len(ranks)})
        return counts

    # -- context parallelism --------------------------------------------------------------------

    def cp_collectives(self, layout: ParallelLayout) -> Counts:
        """Calls per step of the context-parallel group, per attention layer and micro-batch and
        per pass of its attention (`cp_passes`): Ulysses 4 all-to-alls (q, k, v and the output)
        per pass; ring attention cp - 1 exchanges of the stacked K/V block (forward) or of its
        gradient (backward)."""
        if layout.cp == 1:
            return {}
        per_pass = ({Collective.ALL_TO_ALL.value: 4} if layout.cp_strategy == CPStrategy.ULYSSES
                    else {Collective.SEND_RECV.value: layout.cp - 1})
        total: Counts = {}
        for layer, option in zip(self.layers, self._layer_options(layout)):
            if sum(self.structure.attention_bytes.get(self.compute.kind(layer.name), (0.0, 0.0))) == 0:
                continue
            passes = cp_passes(layout.cp_strategy, self.recompute_options[option])
            add(total, per_pass, passes * layout.num_micro_batches)
        return total
