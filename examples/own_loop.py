"""A Hugging Face causal LM trained in a loop of your own, parallelised by autopar's API.

    torchrun --nproc-per-node 2 examples/own_loop.py --steps 20        # CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/own_loop.py plan.tp=2         # any plan.* / train.* override

This file is also the model.py that autopar plans (build_model, example_batch); the loop below
is what a user writes: plan, parallelize, then one `step` per global batch.
"""
import argparse

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
BATCH, SEQ = 8, 32


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CONFIG)


def example_batch(batch_size: int) -> dict:
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ))
    return {"input_ids": ids, "labels": ids}


if __name__ == "__main__":
    import autopar

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-final", default=None, help="save the trained parameters (rank 0) here")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint every step here, resume from it")
    args, overrides = parser.parse_known_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cluster = "dgx_h100" if torch.cuda.is_available() else "cpu_gloo"
    plan = autopar.plan(__file__, f"cluster={cluster}", f"cluster.gpus_per_node={dist.get_world_size()}", *overrides,
                        train={"global_batch_size": BATCH, "precision": "fp32"})
    if dist.get_rank() == 0:
        print(f"plan: {plan.summary()}", flush=True)
    torch.manual_seed(0)  # the same weights on every rank
    training = autopar.parallelize(build_model(), plan, options={"lr": 1e-3, "steps": args.steps,
                                                                  "checkpoint_dir": args.checkpoint_dir,
                                                                  "checkpoint_every": 1 if args.checkpoint_dir else 0})
    for step in range(training.steps_done, args.steps):  # from the checkpoint's step when resuming
        torch.manual_seed(1 + step)  # this step's batch, the same on every rank
        loss = training.step(example_batch(BATCH))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    training.close()
    parameters = training.full_parameters()
    if args.save_final and dist.get_rank() == 0:
        torch.save(parameters, args.save_final)
    # Every rank past its last collective before any tears the group down: gloo aborts a process
    # whose peer exits while a transfer is still winding down.
    dist.barrier()
    dist.destroy_process_group()
