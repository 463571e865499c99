"""The same plan written by hand: what a user writes with torch.distributed alone (torchtitan's way)
for a compiled plan's degrees, micro-batching and precision, to measure what the generated
module's own machinery costs on the same GPU.

It reads only plan.json and the model file copied beside it, and writes the Megatron layout
itself (``parallelize_module`` with the column/row styles per block, the embedding and head by
vocabulary rows, the tied weight tied again), each block under torch.utils.checkpoint where the
plan recomputes, FSDP2 ``fully_shard`` per block and at the root with bf16 compute and fp32
reduction, AdamW (foreach), and the usual accumulation loop. No
data pipeline, metrics, checkpoints or recovery: one batch per micro-batch drawn up front.

    python -m benchmarks.handwritten PLAN_DIR STEPS [autocast]   # one rank; the other ranks faked
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# Per model file: the block container, each block's Megatron layout, and the embedding and head.
LAYOUTS = {
    "gpt.py": ("blocks", {"attn.q_proj": "col", "attn.k_proj": "col", "attn.v_proj": "col", "attn.out_proj": "row",
                          "mlp.fc_in": "col", "mlp.fc_out": "row"}, "wte", "lm_head"),
    "llama_hf.py": ("model.layers", {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
                                     "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
                                     "mlp.down_proj": "row"}, "model.embed_tokens", "lm_head"),
}


def _load_model_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"handwritten_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensor_parallel(model: nn.Module, layout: tuple, tp_mesh) -> None:
    container, per_block, embedding, head = layout
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in model.get_submodule(container):
        parallelize_module(block, tp_mesh, {name: styles[style]() for name, style in per_block.items()})
    tied = model.get_submodule(head).weight is model.get_submodule(embedding).weight
    whole = Replicate()
    parallelize_module(model, tp_mesh, {embedding: RowwiseParallel(input_layouts=whole, output_layouts=whole),
                                        head: ColwiseParallel(output_layouts=whole)})
    if tied:  # both now hold vocabulary rows (Shard(0)): one parameter again, as the model wrote it
        model.get_submodule(head).weight = model.get_submodule(embedding).weight


def _block_recompute(plan: dict) -> str:
    """The recomputation most of the plan's layers take (plan.json gives it per layer)."""
    chosen = plan["recompute"]
    if isinstance(chosen, str):
        return chosen
    values = list(chosen.values())
    return max(set(values), key=values.count) if values else "none"


def selective_context(every_other_matmul: bool = False):
    """A context_fn for torch.utils.checkpoint that keeps the outputs of matrix products and
    attention and reruns the rest (torchtitan's op-level selective checkpointing); with
    ``every_other_matmul``, every second matrix product is rerun too, as torchtitan's published
    runs did (counted apart in forward and in the recomputation, so both pick the same ones)."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    kept = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == aten.mm.default:
            counts[mode] += 1
        keep = op in kept and not (every_other_matmul and op == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def recompute_blocks(blocks, how: str) -> None:
    """Each block under torch.utils.checkpoint: "full" keeps only its input, "selective" and
    "every_other_matmul" keep what `selective_context` keeps (one context per block)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        context = selective_context(how == "every_other_matmul") if how != "full" else None

        def forward(*args, _forward=block.forward, _context=context, **kwargs):
            if _context is None:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=_context, **kwargs)
        block.forward = forward


def _fully_shard(model: nn.Module, container: str, dp_mesh) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.get_submodule(container):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)


def train_handwritten(folder: Path, steps: int, device: torch.device, autocast: bool = False) -> dict:
    """``steps`` optimizer steps of ``folder``'s plan by hand; rank 0 of an initialised group
    (``autocast``: forward and loss under CUDA's bf16 autocast too, as the generated module runs)."""
    plan = json.loads((folder / "plan.json").read_text())
    recompute = _block_recompute(plan)
    if plan["pp"] > 1 or plan["cp"] > 1 or plan["sequence_parallel"] or plan["zero_stage"] not in (0, 1, 3):
        raise ValueError("the hand-written baseline covers dp x tp plans without sequence parallelism")
    model_path = folder / Path(plan["provenance"]["model_path"]).name
    model_file = _load_model_file(model_path)
    kwargs = plan["provenance"]["model_kwargs"]
    torch.manual_seed(0)
    with torch.device(device):
        model = model_file.build_model(**kwargs)
    mesh = init_device_mesh(device.type, (plan["dp"], plan["tp"]), mesh_dim_names=("dp", "tp"))
    layout = LAYOUTS[model_path.name]
    if plan["tp"] > 1:
        _tensor_parallel(model, layout, mesh["tp"])
    if recompute != "none":
        recompute_blocks(model.get_submodule(layout[0]), recompute)
    _fully_shard(model, layout[0], mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    micro, count = plan["micro_batch_size"], plan["num_micro_batches"]
    batch_kwargs = {k: v for k, v in kwargs.items() if k in ("seq_len", "vocab")}
    drawn = [model_file.example_batch(micro, **batch_kwargs) for _ in range(count)]
    batches = [{key: value.to(device) for key, value in batch.items()} for batch in drawn]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "targets")}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model_file.loss_fn(model(**inputs), batch) / count
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"handwritten_step_s": statistics.median(times[2:] or times), "handwritten_peak_bytes": peak}


def measure(folder: Path, steps: int = 5, autocast: bool = False) -> dict:
    """Rank 0 of ``folder``'s plan by hand, the other ranks faked (collectives return at once)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = json.loads((folder / "plan.json").read_text())
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world_size = plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"]
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        return train_handwritten(folder, steps, device, autocast)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    folder, steps, *how = sys.argv[1:]
    print(json.dumps(measure(Path(folder), int(steps), autocast="autocast" in how)))
