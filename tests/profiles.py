"""Traced profiles shared by the cost-model tests (each traced once per session)."""
from __future__ import annotations

import functools
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# A small GPT: s = 256, h = 256, a = 4 heads, micro-batch b = 2; SDPA (flash) attention, no dropout.
S, H, A, B = 256, 256, 4, 2
GPT = {"layers": 4, "hidden": H, "heads": A, "seq_len": S, "vocab": 512}
SBH_BYTES = S * B * H  # Megatron's unit: bytes per element are folded into its coefficients (16-bit)


@functools.lru_cache(maxsize=None)
def traced(example: str = "gpt.py", precision: str = "bf16", micro_batch_size: int = B, **kwargs):
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    return profile_model(load_model_file(EXAMPLES / example), kwargs or GPT, micro_batch_size=micro_batch_size,
                         precision=precision)


def gpt():
    return traced("gpt.py", "bf16", B)



_SPLITTERS: dict[int, object] = {}


def planner_splitter(profile):
    """The planner's TP splitter (autopar.solver.tp_split.ILPSplitter, the split PlanPricer
    prices and codegen emits), one per profile so that estimate()'s per-splitter cache holds."""
    from autopar.solver.tp_split import ILPSplitter

    if id(profile) not in _SPLITTERS:
        _SPLITTERS[id(profile)] = ILPSplitter(profile)
    return _SPLITTERS[id(profile)]


def tp_split(profile, layer: str, tp: int, gpu: str = "A100-80GB"):
    """``layer`` under the planner's TP split over the first ``tp`` GPUs of one node."""
    from cost_models.topology import ClusterConfig, ClusterSpec

    spec = ClusterSpec.from_config(ClusterConfig(name="t", gpu=gpu, nodes=1, gpus_per_node=max(tp, 2)))
    return planner_splitter(profile).split(layer, tp, spec.group_links(list(range(tp))), spec.node_gpus[0])
