"""Where a Hopper GPU's compute time goes at the shapes of the published H100 runs.

The cost model prices each op by its class: a GEMM at the catalogue's large-matmul efficiency
times its shape's tile and wave quantisation (`cost_models.compute.gemm_shape_efficiency`), fused
attention at one efficiency, the memory-bound classes at a share of HBM bandwidth, plus a launch
cost per op. This check measures each of those on one GPU, at the per-rank shapes of Megatron-Core's
H100 weak-scaling rows (A6) and torchtitan's Llama-3.1-8B rows (D7) in benchmarks/published/runs.yaml:

* ``gemm``: every GEMM of one layer (forward, input gradient, weight gradient), alone;
* ``attention``: causal SDPA forward, and forward + backward;
* ``memory``: the layer's norms and activations (forward + backward) and a residual add;
* ``layer``: the example models at the runs' sizes with two layer counts, forward + backward
  with the loss; per-layer wall time by difference, and the kernels' busy time by class from
  torch.profiler (wall minus busy is host time the GPU waited for).

Each measurement is one JSON line; `compare` prices the same work with the cost model. Needs
only torch and transformers on the GPU machine.

    python -m benchmarks.gpu_efficiency_check measure [--tiny] > h200_efficiency.jsonl
    python -m benchmarks.gpu_efficiency_check compare benchmarks/measured/h200_efficiency.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
HEAD_DIM = 128


@dataclass(frozen=True)
class RunShape:
    """One published run's layer as one of its ranks computes it."""

    run: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated: bool  # SwiGLU (gate and up projections) rather than one GELU projection
    vocab: int
    seq_len: int
    micro_batch: int
    tp: int

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    def linears(self) -> list[tuple[str, int, int, int]]:
        """(name, in features, out features, how many per layer) of the rank's linears."""
        h, tp, kv = self.hidden, self.tp, self.kv_heads * HEAD_DIM
        up = [("gate_up", h, self.ffn // tp, 2)] if self.gated else [("fc_in", h, self.ffn // tp, 1)]
        return [("q", h, h // tp, 1), ("kv", h, kv // tp, 2), ("out", h // tp, h, 1), *up,
                ("fc_out", self.ffn // tp, h, 1), ("head", h, self.vocab // tp, 1)]


def _gpt(run: str, layers_hidden: int, heads: int, tp: int) -> RunShape:
    return RunShape(run, layers_hidden, heads, heads, 4 * layers_hidden, False, 131072, 4096, 1, tp)


RUNS = (  # runs.yaml's H100 rows (A6 per rank: heads and FFN split tp ways, full sequence in GEMMs)
    _gpt("A6-1.7B", 2048, 16, 1), _gpt("A6-7.1B", 4096, 32, 2), _gpt("A6-16B", 6144, 48, 4),
    _gpt("A6-32B", 7168, 56, 8), _gpt("A6-70B", 8192, 64, 8), _gpt("A6-177B", 12288, 96, 8),
    _gpt("A6-462B", 18432, 144, 8),
    RunShape("D7-8B", 4096, 32, 8, 14336, True, 128256, 8192, 2, 1),
)
TINY_RUNS = (RunShape("tiny-gpt", 256, 2, 2, 1024, False, 512, 128, 1, 1),
             RunShape("tiny-llama", 256, 2, 1, 640, True, 512, 128, 2, 1))


class Timer:
    """Median seconds of a callable: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device, warmup: int = 3, iters: int = 10):
        import torch

        self.torch, self.device, self.warmup, self.iters = torch, device, warmup, iters

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def __call__(self, work: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            work()
        self._sync()
        samples = []
        for _ in range(self.iters):
            start = time.perf_counter()
            work()
            self._sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


def gemm_records(shape: RunShape, timer: Timer) -> Iterator[dict]:
    import torch

    options = {"device": timer.device, "dtype": torch.bfloat16}
    x = torch.randn(shape.tokens, max(shape.hidden, shape.ffn // shape.tp), **options)
    for name, d_in, d_out, count in shape.linears():
        weight = torch.randn(d_out, d_in, **options) * 0.02
        act, grad = x[:, :d_in], torch.randn(shape.tokens, d_out, **options)
        passes = {"forward": ((shape.tokens, d_out, d_in), lambda: act @ weight.t()),
                  "input_grad": ((shape.tokens, d_in, d_out), lambda: grad @ weight),
                  "weight_grad": ((d_out, d_in, shape.tokens), lambda: grad.t() @ act)}
        for pass_name, ((m, n, k), work) in passes.items():
            seconds = timer(work)
            yield {"kind": "gemm", "run": shape.run, "name": name, "pass": pass_name, "m": m, "n": n, "k": k,
                   "per_layer": count, "seconds": seconds, "tflops": 2 * m * n * k / seconds / 1e12}


def attention_records(shape: RunShape, timer: Timer) -> Iterator[dict]:
    import torch
    import torch.nn.functional as F

    heads = shape.heads // shape.tp
    q, k, v = (torch.randn(shape.micro_batch, heads, shape.seq_len, HEAD_DIM, device=timer.device,
                           dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out_grad = torch.randn_like(q)
    causal_flops = 2 * 2 * shape.micro_batch * heads * shape.seq_len ** 2 * HEAD_DIM / 2

    def both():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(out_grad)

    with torch.no_grad():
        forward_s = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    both_s = timer(both)
    yield {"kind": "attention", "run": shape.run, "batch": shape.micro_batch, "heads": heads, "seq": shape.seq_len,
           "head_dim": HEAD_DIM, "forward_s": forward_s, "forward_backward_s": both_s,
           "forward_tflops": causal_flops / forward_s / 1e12,
           "forward_backward_tflops": 3.5 * causal_flops / both_s / 1e12}


def memory_records(shape: RunShape, timer: Timer) -> Iterator[dict]:
    """Norm and activation kernels at the layer's shapes, forward + backward (bytes: what each
    pass must read and write at 2 bytes an element, the floor HBM traffic)."""
    import torch
    import torch.nn.functional as F

    options = {"device": timer.device, "dtype": torch.bfloat16}
    hidden, inner = shape.hidden, shape.ffn // shape.tp
    norm = (torch.nn.RMSNorm(hidden, eps=1e-5) if shape.gated else torch.nn.LayerNorm(hidden)).to(**options)
    x = torch.randn(shape.tokens, hidden, **options, requires_grad=True)
    gate = torch.randn(shape.tokens, inner, **options, requires_grad=True)
    up = torch.randn(shape.tokens, inner, **options, requires_grad=True)
    cases = {"norm": (lambda: norm(x), x.numel(), 5),  # forward x -> y; backward x, dy -> dx
             "activation": ((lambda: F.silu(gate) * up) if shape.gated else (lambda: F.gelu(gate, approximate="tanh")),
                            gate.numel(), 9 if shape.gated else 5),
             "residual_add": (lambda: x + x, x.numel(), 3)}
    for name, (forward, elements, passes_over) in cases.items():
        out = forward()
        out_grad = torch.randn_like(out)
        seconds = timer(lambda: forward().backward(out_grad))
        yield {"kind": "memory", "run": shape.run, "name": name, "elements": elements, "seconds": seconds,
               "GBps_floor": 2 * elements * passes_over / seconds / 1e9}


def _kernel_class(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(word in lowered for word in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")):
        return "gemm"
    return "other"


def _model_case(shape: RunShape, layers: int, device):
    """The example model at a run's sizes (tp = 1 rows only), built on ``device``, and its micro-batch."""
    import importlib.util

    import torch

    file = "llama_hf.py" if shape.gated else "gpt.py"
    spec = importlib.util.spec_from_file_location(f"example_{file[:-3]}", REPO / "examples" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sizes = {"layers": layers, "hidden": shape.hidden, "heads": shape.heads, "seq_len": shape.seq_len,
             "vocab": shape.vocab}
    if shape.gated:
        sizes.update(kv_heads=shape.kv_heads, ffn=shape.ffn)
    with torch.device(device):
        model = module.build_model(**sizes)
    return module, model, module.example_batch(shape.micro_batch, shape.seq_len, shape.vocab)


def layer_records(shape: RunShape, timer: Timer, counts: tuple[int, int]) -> Iterator[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    walls = {}
    for layers in counts:
        module, model, batch = _model_case(shape, layers, timer.device)
        model = model.to(device=timer.device, dtype=torch.bfloat16)
        batch = {key: value.to(timer.device) for key, value in batch.items()}
        inputs = {key: value for key, value in batch.items() if key not in ("labels", "targets")}

        def step():
            module.loss_fn(model(**inputs), batch).backward()
            for parameter in model.parameters():
                parameter.grad = None

        walls[layers] = timer(step)
        record = {"kind": "layer", "run": shape.run, "layers": layers, "micro_batch": shape.micro_batch,
                  "wall_s": walls[layers]}
        if timer.device.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            busy: dict[str, float] = {}
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kind = _kernel_class(event.name)
                    busy[kind] = busy.get(kind, 0.0) + event.device_time / 1e6
            record["busy_s"] = busy
        yield record
    low, high = counts
    yield {"kind": "layer_difference", "run": shape.run, "per_layer_wall_s": (walls[high] - walls[low]) / (high - low)}


def host_records(timer: Timer) -> Iterator[dict]:
    """Seconds per eager op issued back to back on tiny tensors (the host's floor per kernel)."""
    import torch

    a = torch.ones(8, device=timer.device)
    ops = 1000

    def issue():
        for _ in range(ops):
            a.add_(1.0)

    yield {"kind": "host", "name": "eager_add", "seconds_per_op": timer(issue) / ops}


def measure(tiny: bool) -> None:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    timer = Timer(device, warmup=1 if tiny else 3, iters=2 if tiny else 10)
    header = {"kind": "device", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    print(json.dumps(header), flush=True)
    runs = TINY_RUNS if tiny else RUNS
    for shape in runs:
        for record in [*gemm_records(shape, timer), *attention_records(shape, timer), *memory_records(shape, timer)]:
            print(json.dumps({**record, "shape": asdict(shape)}), flush=True)
    for shape in runs:
        if shape.tp == 1:
            for record in layer_records(shape, timer, (1, 3) if shape.gated else (2, 6)):
                print(json.dumps(record), flush=True)
    for record in host_records(timer):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=["measure", "compare"])
    parser.add_argument("file", nargs="?")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a check of the script)")
    args = parser.parse_args()
    if args.verb == "measure":
        measure(args.tiny)
    else:
        from benchmarks.gpu_efficiency_compare import compare

        compare(Path(args.file))
