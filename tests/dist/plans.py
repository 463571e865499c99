"""Plans for the code-generation tests, built in one place.

Each plan is what the operator-wise TP solver and the stage partitioner choose for our tiny
models (Megatron pairing: attention q/k/v and MLP-in column-parallel, their outputs row-parallel,
the LM head column-parallel with loss parallel, the embedding vocabulary-parallel), with the
degrees, ZeRO stage, schedule and recomputation of the case pinned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autopar.plan import Plan, Provenance

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
    block_tp: dict[str, str]  # block-relative module -> style
    top_tp: dict[str, str] = field(default_factory=dict)
    # A split the operator-wise solver also returns for tiny layers, where communication
    # outweighs compute: attention inputs column-parallel, the rest replicated.
    mixed_tp: dict[str, str] = field(default_factory=dict)

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
    block_tp={"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
              "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"},
    top_tp={"wte": "vocab_parallel", "wpe": "replicate", "lm_head": "colwise"},
    mixed_tp={"attn.out_proj": "replicate", "mlp.fc_in": "replicate", "mlp.fc_out": "replicate"},
)
LLAMA = TinyModel(
    name="llama_hf", path=REPO / "examples" / "llama_hf.py",
    kwargs=dict(layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=16),
    prologue=["model.embed_tokens"], container="model.layers", blocks=4, epilogue=["model.norm", "lm_head"],
    block_tp={"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"},
    top_tp={"model.embed_tokens": "vocab_parallel", "lm_head": "colwise"},
    mixed_tp={"self_attn.o_proj": "replicate", "mlp.gate_proj": "replicate", "mlp.up_proj": "replicate",
              "mlp.down_proj": "replicate"},
)
MODELS = {m.name: m for m in (GPT, LLAMA)}


def split_stages(model: TinyModel, count: int) -> list[list[str]]:
    """``count`` contiguous stages: embeddings with the first blocks, norm and head with the last;
    with as many stages as blocks + 2, embeddings and head get stages of their own."""
    blocks = model.block_names
    if count == len(blocks) + 2:
        return [model.prologue] + [[b] for b in blocks] + [model.epilogue]
    per = [len(blocks) // count + (1 if i < len(blocks) % count else 0) for i in range(count)]
    stages, start = [], 0
    for size in per:
        stages.append(blocks[start:start + size])
        start += size
    stages[0] = model.prologue + stages[0]
    stages[-1] = stages[-1] + model.epilogue
    return stages


def boundary_stages(model: TinyModel) -> list[list[str]]:
    """Four stages cut where the planner cuts tiny models: embeddings alone, two blocks, two
    blocks, norm and head. Exercises a stage starting at the first block (which enters sequence
    parallelism) and one starting at the final norm."""
    blocks = model.block_names
    return [model.prologue, blocks[:2], blocks[2:], model.epilogue]


def make_plan(model: TinyModel, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False,
              schedule: str = "1f1b", chunks: int = 1, recompute: dict[str, str] | None = None,
              num_micro_batches: int | None = None, stages: list[list[str]] | None = None,
              hybrid: bool = False, mixed_tp: bool = False) -> Plan:
    """A plan for ``model`` with the given pins and the solver's TP split."""
    per_rank = GLOBAL_BATCH // dp
    n = num_micro_batches or (4 if pp > 1 else 2)
    n = min(n, per_rank)
    virtual = pp * (chunks if schedule == "interleaved_1f1b" else 1)
    tp_styles = {}
    if tp > 1:
        tp_styles.update(model.top_tp)
        for block in model.block_names:
            tp_styles.update({f"{block}.{k}": v for k, v in model.block_tp.items()})
            if mixed_tp:
                tp_styles.update({f"{block}.{k}": v for k, v in model.mixed_tp.items()})
    layers = model.layer_names
    return Plan(
        dp=dp, tp=tp, pp=pp, cp=1, mesh_order=["tp", "cp", "pp", "dp"], zero_stage=zero, hybrid_shard=hybrid,
        micro_batch_size=per_rank // n, num_micro_batches=n, schedule=schedule,
        chunks=chunks if schedule == "interleaved_1f1b" else 1,
        stages=stages or split_stages(model, virtual),
        recompute={layer: (recompute or {}).get(layer, "none") for layer in layers},
        tp_styles=tp_styles, sequence_parallel=sp and tp > 1, loss_parallel=tp > 1,
        layer_names=layers, block_container=model.container, global_batch_size=GLOBAL_BATCH,
        precision="fp32", optimizer="adam",
        provenance=Provenance(model_path=str(model.path), model_kwargs=dict(model.kwargs)),
    )
