"""Plans for the code-generation tests, built in one place.

Each plan comes from the planner with the case's degrees, ZeRO stage, schedule, micro-batching,
sequence parallelism and (where the case needs them) stage split and recomputation pinned; the
operator-wise TP split, the mesh order and the other choices are the solver's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autopar.config import PlanPins, SolverConfig
from autopar.model_file import load_model_file
from autopar.plans import Plan
from autopar.profile import profile_model
from autopar.solver.planner import Planner
from cost_models.step import TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8


@dataclass(frozen=True)
class TinyModel:
    """A model file at test size and how its layers are named."""

    name: str
    path: Path
    kwargs: dict
    prologue: list[str]  # layers before the block container
    container: str
    blocks: int
    epilogue: list[str]  # layers after it

    @property
    def block_names(self) -> list[str]:
        return [f"{self.container}.{i}" for i in range(self.blocks)]

    @property
    def layer_names(self) -> list[str]:
        return self.prologue + self.block_names + self.epilogue


GPT = TinyModel(
    name="gpt", path=REPO / "examples" / "gpt.py",
    kwargs=dict(layers=4, hidden=32, heads=4, seq_len=16, vocab=64),
    prologue=["wte", "wpe"], container="blocks", blocks=4, epilogue=["ln_f", "lm_head"],
)
LLAMA = TinyModel(
    name="llama_hf", path=REPO / "examples" / "llama_hf.py",
    kwargs=dict(layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=16),
    prologue=["model.embed_tokens"], container="model.layers", blocks=4, epilogue=["model.norm", "lm_head"],
)
MODELS = {m.name: m for m in (GPT, LLAMA)}


def boundary_stages(model: TinyModel) -> list[list[str]]:
    """Four stages cut where the planner cuts tiny models: embeddings alone, two blocks, two
    blocks, norm and head. Exercises a stage starting at the first block (which enters sequence
    parallelism) and one starting at the final norm."""
    blocks = model.block_names
    return [model.prologue, blocks[:2], blocks[2:], model.epilogue]


# Communication priced as on a fast intra-node link: the operator-wise solver then picks
# Megatron's pairing for the tiny blocks. At 40 µs per message it splits part of each block and
# replicates the rest (communication outweighs their compute): a genuinely mixed split.
FAST_LINK_US, SLOW_LINK_US = 3.0, 40.0
_PROFILES: dict[tuple[str, str, str], object] = {}


def _profile(model: TinyModel):
    key = (model.name, str(model.path), repr(sorted(model.kwargs.items())))  # two sizes of one file differ
    if key not in _PROFILES:
        _PROFILES[key] = profile_model(load_model_file(model.path), dict(model.kwargs), 1, "fp32")
    return _PROFILES[key]


def make_plan(model: TinyModel, **choices) -> Plan:
    """The planner's plan for ``model`` with the case's choices pinned (see `make_planner`)."""
    return make_planner(model, **choices).run().plan


def make_planner(model: TinyModel, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False,
                 schedule: str = "1f1b", chunks: int = 1, recompute: dict[str, str] | None = None,
                 num_micro_batches: int | None = None, stages: list[list[str]] | None = None,
                 hybrid: bool = False, mixed_tp: bool = False, gpus_per_node: int | None = None, cp: int = 1,
                 cp_strategy: str | None = None, dp_sync: str | None = None,
                 dp_shares: list[int] | None = None) -> Planner:
    """The planner for ``model`` with the case's choices pinned; everything else (the
    operator-wise TP split, mesh order, the stage split where not pinned) is the solver's. Its
    `pricer` prices the plan it makes."""
    per_rank = GLOBAL_BATCH // dp
    n = min(num_micro_batches or (4 if pp > 1 else 2), per_rank)
    world = dp * tp * pp * cp
    cluster = ClusterSpec.from_config(ClusterConfig(
        name="tiny_cpu", gpu="cpu", nodes=world // (gpus_per_node or world), gpus_per_node=gpus_per_node or world,
        intra_node_latency_us=SLOW_LINK_US if mixed_tp else FAST_LINK_US, intra_node_bandwidth_GBps=1.5))
    pins = PlanPins(dp=dp, tp=tp, pp=pp, cp=cp, cp_strategy=cp_strategy, dp_sync=dp_sync, dp_shares=dp_shares,
                    zero_stage=zero, hybrid_shard=hybrid, micro_batch_size=per_rank // n,
                    sequence_parallel=sp and tp > 1, schedule=schedule if pp > 1 else None,
                    chunks=chunks if schedule == "interleaved_1f1b" else 1, stages=stages,
                    layer_recompute=recompute)
    solver = SolverConfig(time_limit_s=60, top_k=0)
    train = TrainSpec(global_batch_size=GLOBAL_BATCH, precision="fp32", optimizer="adam")
    return Planner(_profile(model), cluster, train, solver, pins)
