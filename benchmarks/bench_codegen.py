"""Overhead of generated code: its step time vs a hand-written torch.distributed version of the
same plan (GPT, 4 gloo ranks: dp 2 x tp 2, ZeRO-3, sequence and loss parallel).

Both versions are built in the same 4 processes from the same weights and trained on the same
batches; their steps alternate (generated, hand-written, generated, ...) so machine noise hits
both alike. ratio = hand-written / generated step time (1.0: no overhead; target >= 0.97).

    python -m benchmarks.bench_codegen

On a GPU, ``fake_rank_memory`` runs rank 0 of a generated module for a large plan with torch's
``fake`` process-group backend standing in for the other ranks (collectives return at once), so
one GPU shows the memory one rank of the full plan would use, to compare with the plan's
predicted peak:

    python -m benchmarks.bench_codegen --fake-rank OUT_DIR      # OUT_DIR from autopar compile
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.generated import command_line, import_generated
from benchmarks import sized

REPO = Path(__file__).resolve().parent.parent
GPT = {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 512}
RANKS = 4
WARMUP, MEASURED = sized(2, 1), sized(12, 2)


def _plan():
    from autopar.plans import Plan, Provenance

    blocks = [f"blocks.{i}" for i in range(GPT["layers"])]
    styles = {"wte": "vocab_parallel", "lm_head": "colwise"}
    for block in blocks:
        styles.update({f"{block}.attn.q_proj": "colwise", f"{block}.attn.k_proj": "colwise",
                       f"{block}.attn.v_proj": "colwise", f"{block}.attn.out_proj": "rowwise",
                       f"{block}.mlp.fc_in": "colwise", f"{block}.mlp.fc_out": "rowwise"})
    layers = ["wte", "wpe"] + blocks + ["ln_f", "lm_head"]
    return Plan(dp=2, tp=2, zero_stage=3, micro_batch_size=2, num_micro_batches=2, stages=[layers],
                recompute=dict.fromkeys(layers, "none"), tp_styles=styles, sequence_parallel=True,
                loss_parallel=True, layer_names=layers, block_containers=["blocks"], global_batch_size=8,
                precision="fp32", provenance=Provenance(model_kwargs=GPT))


# -- the hand-written version of the same plan --------------------------------------------------

def _hand_written(model_file, seed: int):
    """The plan written by hand with torch's APIs, the way a user would without autopar."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = model_file.build_model(**GPT)
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(GPT["layers"]):
        for norm in ("ln_1", "ln_2"):
            plan[f"blocks.{i}.{norm}"] = SequenceParallel()
        for region in ("attn", "mlp"):
            plan[f"blocks.{i}.{region}"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                             desired_input_layouts=(Replicate(),),
                                                             use_local_output=True)
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out_proj", "mlp.fc_out"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    parallelize_module(model, mesh["tp"], plan)
    model.lm_head.weight = model.wte.weight
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model.ln_f, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return model, optimizer, mesh["dp"].get_local_rank()


def _hand_step(model, optimizer, batch: dict, model_file) -> float:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    total = 0.0
    for i in range(2):
        micro = {k: v[i * 2:(i + 1) * 2] for k, v in batch.items()}
        with loss_parallel():
            loss = model_file.loss_fn(model(micro["tokens"]), micro)
            (loss / 2).backward()
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
    optimizer.step()
    optimizer.zero_grad()
    value = torch.tensor(total / 2, dtype=torch.float64)
    dist.all_reduce(value)
    return float(value) / RANKS


def _hand_batch(generated: Any, training: Any, model_module: Any, step: int, dp_rank: int) -> Any:
    """The hand-written run's slice of step ``step``'s batch: the same samples the generated
    module's rank of that data-parallel index reads (its own mesh may order ranks otherwise)."""
    whole = generated.make_batch(model_module, training.model_kwargs, training.global_batch_size,
                                 training.seed + 1 + step)
    first, size = training.share(dp_rank)
    return generated.slice_batch(whole, first, first + size * training.num_micro_batches)


# -- side by side --------------------------------------------------------------------------------

def _rank(rank: int, port: int, script: str, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=RANKS)
        generated = import_generated(script, "generated_bench")
        args = command_line(generated)
        training, config = generated.train_config(generated.PLAN, args), generated.parallel_config(generated.PLAN)
        model_module = generated.load_model_file(training.model_file)
        parallel = generated.setup(training, config, generated.tp_plan, model_module, torch.device("cpu"))
        model, optimizer, hand_dp_rank = _hand_written(model_module, training.seed)
        times = {"generated": [], "hand_written": []}
        losses = {"generated": [], "hand_written": []}
        for step in range(WARMUP + MEASURED):
            batch = generated.local_batch(training, config, model_module, step, parallel.mesh, torch.device("cpu"))
            hand_batch = _hand_batch(generated, training, model_module, step, hand_dp_rank)
            # Alternate which goes first so neither always follows the other's cache state.
            order = ("generated", "hand_written") if step % 2 == 0 else ("hand_written", "generated")
            for which in order:
                dist.barrier()
                start = time.perf_counter()
                if which == "generated":
                    loss = generated.global_loss(generated.train_step(parallel, batch, training, config, model_module),
                                                 config.dims, torch.device("cpu"))
                else:
                    loss = _hand_step(model, optimizer, hand_batch, model_module)
                elapsed = time.perf_counter() - start
                if step >= WARMUP:
                    times[which].append(elapsed)
                losses[which].append(loss)
        queue.put((rank, times, losses))
    except Exception as err:  # noqa: BLE001 - reported to the parent instead of hanging it
        import traceback
        queue.put((rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}", None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run() -> dict:
    from autopar.codegen import generate

    with tempfile.TemporaryDirectory() as folder:
        script = generate(_plan(), REPO / "examples" / "gpt.py", folder).script
        context = mp.get_context("spawn")
        queue = context.Queue()
        port = _free_port()
        processes = [context.Process(target=_rank, args=(rank, port, str(script), queue)) for rank in range(RANKS)]
        for process in processes:
            process.start()
        results = [queue.get(timeout=900) for _ in range(RANKS)]
        for process in processes:
            process.join()
    errors = [value for _, value, losses in results if losses is None]
    if errors:
        raise RuntimeError(errors[0])
    times, losses = next(value for rank, value, losses in results if rank == 0), results[0][2]
    generated_s = statistics.median(times["generated"])
    hand_s = statistics.median(times["hand_written"])
    return {
        "plan": "GPT 4x128, dp2 x tp2, ZeRO-3, SP, loss parallel, 4 gloo ranks",
        "generated_step_ms": round(generated_s * 1e3, 2),
        "hand_written_step_ms": round(hand_s * 1e3, 2),
        "ratio": round(hand_s / generated_s, 3),
        "target": ">= 0.97",
        "same_losses": all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses["generated"], losses["hand_written"])),
        "steps_measured": MEASURED,
    }


def fake_rank_memory(out_dir: str | Path, steps: int = 3) -> dict:
    """Rank 0 of ``out_dir``'s generated module on this GPU, other ranks faked; peak memory of
    the training steps (set-up excluded) against the plan's prediction. Needs torch and this
    repository only (autopar.runtime.generated imports nothing else)."""
    import json

    from torch.testing._internal.distributed.fake_pg import FakeStore

    out_dir = Path(out_dir)
    plan = json.loads((out_dir / "plan.json").read_text())
    world_size = plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"]
    if plan["pp"] > 1:
        raise ValueError("a faked pipeline rank cannot run: stages exchange shapes with their neighbours "
                         "before the first step, and the fake backend carries no data")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        script = next(out_dir.glob("parallel_*.py"))
        generated = import_generated(script, "generated_fake_rank")
        args = command_line(generated, steps=steps)
        records = generated.train(generated.train_config(generated.PLAN, args),
                                  generated.parallel_config(generated.PLAN), generated.tp_plan)
    finally:
        dist.destroy_process_group()
    measured = max(r["peak_memory_bytes"] for r in records)
    predicted = plan["predicted"]["peak_memory_bytes"]
    return {"plan": script.name, "world_size": world_size,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "measured_peak_GiB": round(measured / 2**30, 2), "predicted_peak_GiB": round(predicted / 2**30, 2),
            "measured_over_predicted": round(measured / predicted, 3) if predicted else None,
            "step_time_s": [round(r["step_time_s"], 4) for r in records]}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--fake-rank":
        print(fake_rank_memory(sys.argv[2]))
    else:
        print(run())
