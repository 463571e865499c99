"""Selective recomputation two ways on a GPU, at torchtitan's Llama-3.1-8B shape (runs.yaml D7):
keeping every matrix product and attention output (autopar's `selective`), and keeping every
other matrix product only (torchtitan's op-level policy in its published runs). Step time
(forward + backward) and peak memory of a decoder stack, with no recomputation beside them (the
policies are benchmarks/handwritten.py's).

    python -m benchmarks.gpu_recompute_check > h100_recompute.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LAYERS = 3


def measure(how: str) -> dict:
    import torch
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from benchmarks.gpu_efficiency_check import RUNS, Timer, _model_case
    from benchmarks.handwritten import recompute_blocks

    shape = next(run for run in RUNS if run.run == "D7-8B")
    module, model, batch = _model_case(shape, LAYERS, torch.device("cuda"))
    model = model.to(torch.bfloat16)
    if how != "none":
        recompute_blocks(model.model.layers, "selective" if how == "keep_every_matmul" else how)
    batch = {key: value.cuda() for key, value in batch.items()}
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "targets")}

    def step():
        # The recomputation runs whole: stopped early, it would count fewer matrix products than
        # the forward did, and the next step's every-other choice would fall on other ones.
        with set_checkpoint_early_stop(False):
            module.loss_fn(model(**inputs), batch).backward()
        model.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    seconds = Timer(torch.device("cuda"))(step)
    peak = torch.cuda.max_memory_allocated() - base
    return {"kind": "recompute", "how": how, "layers": LAYERS, "step_s": seconds, "peak_above_weights_bytes": peak}


if __name__ == "__main__":
    import torch

    print(json.dumps({"kind": "device", "device": torch.cuda.get_device_name(), "torch": torch.__version__}),
          flush=True)
    for how in ("none", "keep_every_matmul", "every_other_matmul"):
        print(json.dumps(measure(how)), flush=True)
        torch.cuda.empty_cache()
