"""Cost models: price any parallel plan on any GPU cluster (compute, collectives, memory, pipeline).

    from cost_models import ClusterConfig, ClusterSpec, ParallelLayout, TrainSpec, estimate
    cluster = ClusterSpec.from_config(ClusterConfig(name="a100", gpu="A100-80GB", nodes=2, gpus_per_node=8))
    est = estimate(profile, cluster, ParallelLayout(dp=2, tp=8, micro_batch_size=2, num_micro_batches=4),
                   TrainSpec(global_batch_size=16), tp_splitter)
    est.step_time_s, est.mfu, est.peak_memory_bytes, est.time_breakdown

Of autopar it imports only the plan's domain (autopar.domain: the layout, its vocabulary, rules
and technique registry), which imports nothing above it; it reads a ModelProfile by duck typing. Tensor parallelism is
priced by the split the planner chooses and codegen emits, passed in as ``tp_splitter``
(autopar.solver.tp_split.ILPSplitter(profile)); without one, only tp = 1 is priced.
"""
from cost_models.collectives import (Algorithm, Collective, CollectiveCost, Protocol, best_algorithm, bus_bandwidth,
                                     collective_time_s)
from cost_models.compute import ComputeModel, LayerCompute, op_time_s
from cost_models.layer_split import TPLayerSplit, TPSplitter
from cost_models.hardware import CATALOGUE, DEFAULT_EFFICIENCY, GPUSpec, get_gpu, known_gpus
from cost_models.memory import (LayerActivations, ModelStates, activation_bytes, megatron_layer_activation_bytes,
                                model_states)
from cost_models.held_activations import held_moments
from cost_models.pipeline import bubble_fraction, pipeline_step_time_s
from cost_models.step import Estimate, ParallelLayout, PlanPricer, TrainSpec, estimate, validate_layout
from cost_models.topology import ClusterConfig, ClusterSpec, GroupPlacement, Link, NodeGroupConfig

__all__ = [
    "Algorithm", "Collective", "CollectiveCost", "Protocol", "best_algorithm", "bus_bandwidth", "collective_time_s",
    "ComputeModel", "LayerCompute", "op_time_s",
    "CATALOGUE", "DEFAULT_EFFICIENCY", "GPUSpec", "get_gpu", "known_gpus",
    "LayerActivations", "ModelStates", "activation_bytes", "megatron_layer_activation_bytes", "model_states",
    "bubble_fraction", "held_moments", "pipeline_step_time_s",
    "Estimate", "ParallelLayout", "PlanPricer", "TrainSpec", "estimate", "validate_layout",
    "ClusterConfig", "ClusterSpec", "GroupPlacement", "Link", "NodeGroupConfig",
    "TPLayerSplit", "TPSplitter",
]
