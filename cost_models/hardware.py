"""GPU catalogue: dense peak FLOP/s per dtype, memory size and bandwidth, intra-node link.

Every number is a vendor datasheet figure for dense math (no sparsity); the source is named on
each entry. Peaks are what the silicon can do; `efficiency` is the fraction of it that each op
class reaches in practice. The GEMM defaults come from measured dense bf16 matmuls
(stas00/ml-engineering, "Maximum Achievable Matmul FLOPS": A100 87%, H100 80%, B200 78%);
calibration (`cost_models.calibrate`) overwrites peaks, efficiencies and launch overhead with
measurements of the machine at hand.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from cost_models.calibration import load_calibration

TERA = 1e12
GB = 1e9
GiB = 2**30

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

# Fraction of peak FLOP/s (gemm, attention: compute-bound classes) or of memory bandwidth (the
# memory-bound classes) that a kernel of each class reaches. GEMM: the measured matmul shares
# above; fused attention: 52% of peak on the work it computes (a causal kernel skips the keys
# past each query block, `cost_models.compute.attention_work_share`), forward and backward
# together, as PyTorch's SDPA ran on an H200 with 64-128 heads x 8192 tokens in flight
# (benchmarks/measured/h200_power.jsonl; 61% forward alone); element-wise and copy kernels
# stream at ~70% of HBM bandwidth, norms and reductions a little lower (two passes or a
# reduction tree).
DEFAULT_EFFICIENCY = {
    "gemm": 0.80, "attention": 0.52, "elementwise": 0.70, "norm": 0.60, "reduction": 0.60,
    "memory": 0.70, "other": 0.50, "view": 1.0,
}

# Host-side cost of one eager PyTorch op on a GPU (dispatcher + kernel launch). Fitted to the
# H100 forward/backward timings committed in benchmarks/measured/ (tests/unit/test_cost_vs_gpu.py).
DEFAULT_LAUNCH_OVERHEAD_S = 9e-6


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type.

    Attributes:
        name: catalogue key, e.g. "H100-SXM".
        peak_flops: dense peak FLOP/s per dtype name (fp32, tf32, bf16, fp16, fp8).
        memory_bytes: device memory (HBM) in bytes.
        memory_bandwidth_Bps: device memory bandwidth, bytes per second.
        intra_node_link: interconnect between the GPUs of one node (NVLink generation, PCIe).
        intra_node_bandwidth_GBps: per-GPU unidirectional bandwidth on that link.
        efficiency: achievable fraction per op class (see DEFAULT_EFFICIENCY).
        launch_overhead_s: fixed time per op (kernel launch and framework dispatch).
        source: where the numbers come from.
        sm_count: streaming multiprocessors (AMD: compute units), what a GEMM's output tiles are
            spread over in waves (`cost_models.compute.gemm_shape_efficiency`); 0 leaves GEMM
            efficiency independent of shape.
        rated_power_W: the board power limit the datasheet rates (0: unknown).
        idle_power_W: board power with nothing running (0: not measured; all power counted dynamic).
        power_limit_W: the limit this cluster runs its GPUs at (0: the rated one); a lower one
            slows compute-bound work by `clock_share`.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth_Bps: float
    intra_node_link: str
    intra_node_bandwidth_GBps: float
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    launch_overhead_s: float = DEFAULT_LAUNCH_OVERHEAD_S
    source: str = ""
    sm_count: int = 0  # streaming multiprocessors (compute units): GEMM wave quantisation; 0 = not modelled
    rated_power_W: float = 0.0
    idle_power_W: float = 0.0
    power_limit_W: float = 0.0

    @property
    def clock_share(self) -> float:
        """Share of its rated-power clock a GPU sustains under a lower power limit.

        Training holds a GPU at its power limit: an H100 SXM rated 700 W drew 689 W training Llama
        layers and 698 W on a long bf16 GEMM, its SM clock falling from 1980 to 1605 and 1380 MHz
        while its memory clock stayed put (an H200: 687 and 691 W, 1620 and 1485 MHz;
        benchmarks/measured/h100_power.jsonl, h200_power.jsonl). Dynamic
        power goes as frequency times voltage squared, and voltage rises about linearly with
        frequency over the DVFS range, so the clock a limit sustains goes as the cube root of the
        dynamic power it allows: ((limit - idle) / (rated - idle))^(1/3). Only compute-bound work
        slows; memory bandwidth does not (`sustained_flops`)."""
        if not self.power_limit_W or not self.rated_power_W or self.power_limit_W >= self.rated_power_W:
            return 1.0
        return ((self.power_limit_W - self.idle_power_W) / (self.rated_power_W - self.idle_power_W)) ** (1 / 3)

    def sustained_flops(self, dtype: str) -> float:
        """Peak FLOP/s at the clock this GPU's power limit sustains (what compute-bound ops are
        priced against; the datasheet peak stays the MFU denominator)."""
        return self.flops(dtype) * self.clock_share

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype; bf16 and fp16 stand in for each other (same tensor-core
        rate on every GPU here that has both)."""
        for name in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise KeyError(f"{self.name} has no {dtype} peak (it has {', '.join(sorted(self.peak_flops))})")

    def efficiency_of(self, op_class: str) -> float:
        return self.efficiency.get(op_class, self.efficiency.get("other", DEFAULT_EFFICIENCY["other"]))

    @functools.cached_property
    def signature(self) -> tuple:
        """Hashable identity of every number that prices an op: the cache key for per-layer
        compute (a calibrated "cpu" and the catalogue's "cpu" must not share cached times)."""
        return (self.name, tuple(sorted(self.peak_flops.items())), self.memory_bandwidth_Bps,
                tuple(sorted(self.efficiency.items())), self.launch_overhead_s, self.sm_count, self.clock_share)

    def with_overrides(self, **changes) -> "GPUSpec":
        return replace(self, **changes)


def _gpu(name: str, *, peaks_tflops: dict[str, float], memory_gb: float, bandwidth_GBps: float, link: str,
         link_GBps: float, source: str, memory_gib: bool = False,
         efficiency: dict[str, float] | None = None, sm_count: int = 0, watts: float = 0.0,
         idle_watts: float = 0.0) -> GPUSpec:
    eff = dict(DEFAULT_EFFICIENCY)
    eff.update(efficiency or {})
    return GPUSpec(name=name, peak_flops={dtype: tflops * TERA for dtype, tflops in peaks_tflops.items()},
                   memory_bytes=int(memory_gb * (GiB if memory_gib else GB)), memory_bandwidth_Bps=bandwidth_GBps * GB,
                   intra_node_link=link, intra_node_bandwidth_GBps=link_GBps, efficiency=eff, source=source,
                   sm_count=sm_count, rated_power_W=watts, idle_power_W=idle_watts)


# Fitted to published runs (benchmarks/published/runs.yaml, `python -m benchmarks.published.refit`
# writes it to cost_models/calibration.json): per GPU family, the factor on compute-bound seconds
# (compute, recomputation, bubble, optimizer) minimising the squared relative step-time errors
# of its calibration rows, communication priced as is (`benchmarks.published.refit.fit_scale`).
# A100 (18 Megatron-LM rows, A1 and B4): 1.04. It was 1.19 while those runs were priced with a
# fused attention kernel; they ran Megatron-LM's attention of 2021-22, written out (scores by a
# batched matmul, a softmax over them, dropout, a second matmul: a*s^2 values through memory
# several times a layer), and are priced so (examples/gpt.py attention=unfused, with its
# dropouts), their selective rows with the attention core rerun as Megatron-LM's selective
# recomputation reruns it (so does autopar's, cost_models/weights.py).
# Hopper is not fitted: Megatron-Core's nine H100 rows (A6, priced with the overlaps they ran:
# cost_models/engine_overlap.py, and the fp32 gradient reductions Megatron-LM runs under bf16)
# would take 1.06 and torchtitan's two rows on 500 W, 2.4 TB/s Grand Teton H100s (D7, priced with
# torchtitan's op-level selective checkpointing and fp32 reductions) 1.13; the layer compute
# they would scale measured within a few percent on an H100 (docs/measuring.md), so the factor is
# not read as the GPU's. Priced from the datasheets, the measured attention and power laws
# (`GPUSpec.clock_share`).
COMPUTE_TIME_SCALE: dict[str, float] = dict(load_calibration()["compute_time_scale"])
UNSCALED_EFFICIENCY: dict[str, dict[str, float]] = {"A100": {"gemm": 0.87}}


def _fitted(efficiency: dict[str, float], time_scale: float) -> dict[str, float]:
    """Every class's efficiency (defaults completed by `overrides`) divided by a fitted scale."""
    return {name: round(value / time_scale, 3) for name, value in {**DEFAULT_EFFICIENCY, **efficiency}.items()
            if name != "view"}


# Idle board power, measured (benchmarks/measured/h100_power.jsonl, h200_power.jsonl).
H100_SXM_IDLE_W, H200_IDLE_W = 128.0, 121.0

# watts: each datasheet's maximum board power (V100 SXM2 300, A100 SXM 400, H100/H200 SXM 700,
# H100 PCIe 350, B200 1,000, L40S 350, MI300X 750 W).
# sm_count: NVIDIA's architecture whitepapers (V100 80, A100 108, H100 SXM5 132, H100 PCIe 114,
# L40S 142, B200 148 per GPU) and AMD's MI300X datasheet (304 compute units).
CATALOGUE: dict[str, GPUSpec] = {spec.name: spec for spec in (
    # NVIDIA V100 datasheet (SXM2 32GB): 15.7 fp32, 125 fp16 tensor TFLOP/s; 900 GB/s HBM2;
    # NVLink 2 at 150 GB/s per direction. Volta has no bf16 tensor cores: bf16 math runs on the
    # CUDA cores at the fp32 rate.
    _gpu("V100-32GB", peaks_tflops={"fp32": 15.7, "fp16": 125, "bf16": 15.7}, memory_gb=32, bandwidth_GBps=900,
         link="NVLink2", link_GBps=150, source="NVIDIA V100 datasheet", sm_count=80, watts=300),
    # NVIDIA A100 datasheet (SXM): 19.5 fp32, 156 tf32, 312 bf16/fp16; 40 GB HBM2 at 1,555 GB/s
    # or 80 GB HBM2e at 2,039 GB/s; NVLink 3 at 300 GB/s per direction. No fp8.
    _gpu("A100-40GB", peaks_tflops={"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, memory_gb=40,
         bandwidth_GBps=1555, link="NVLink3", link_GBps=300, source="NVIDIA A100 datasheet",
         efficiency=_fitted(UNSCALED_EFFICIENCY["A100"], COMPUTE_TIME_SCALE["A100"]), sm_count=108, watts=400),
    _gpu("A100-80GB", peaks_tflops={"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, memory_gb=80,
         bandwidth_GBps=2039, link="NVLink3", link_GBps=300, source="NVIDIA A100 datasheet",
         efficiency=_fitted(UNSCALED_EFFICIENCY["A100"], COMPUTE_TIME_SCALE["A100"]), sm_count=108, watts=400),
    # NVIDIA H100 datasheet, SXM5: 67 fp32, 494.5 tf32, 989 bf16/fp16, 1,979 fp8 (dense, half the
    # sparsity figures); 80 GB HBM3 at 3,350 GB/s; NVLink 4 at 450 GB/s per direction; up to 700 W.
    _gpu("H100-SXM", peaks_tflops={"fp32": 67, "tf32": 494.5, "bf16": 989, "fp16": 989, "fp8": 1979}, memory_gb=80,
         bandwidth_GBps=3350, link="NVLink4", link_GBps=450, source="NVIDIA H100 datasheet", sm_count=132,
         watts=700, idle_watts=H100_SXM_IDLE_W),
    # The H100 SXM with 96 GB of HBM2e at 2.4 TB/s (Meta's Grand Teton servers, whose runs the
    # torchtitan benchmarks report; they power-limit them, `cluster=grand_teton_h100`): the SXM5
    # die and clocks with slower memory.
    _gpu("H100-SXM-96GB", peaks_tflops={"fp32": 67, "tf32": 494.5, "bf16": 989, "fp16": 989, "fp8": 1979},
         memory_gb=96, bandwidth_GBps=2400, link="NVLink4", link_GBps=450,
         source="NVIDIA H100 SXM5 die; 96 GB HBM2e at 2.4 TB/s as torchtitan's H100 benchmark states", sm_count=132,
         watts=700, idle_watts=H100_SXM_IDLE_W),
    # Same datasheet, PCIe card: 51 fp32, 378 tf32, 756 bf16/fp16, 1,513 fp8; 80 GB HBM2e at
    # 2,000 GB/s; PCIe Gen5 x16 (64 GB/s per direction) between cards.
    _gpu("H100-PCIe", peaks_tflops={"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513}, memory_gb=80,
         bandwidth_GBps=2000, link="PCIe5", link_GBps=64, source="NVIDIA H100 datasheet", sm_count=114,
         watts=350),
    # NVIDIA H200 product page: H100 SXM compute; 141 GB HBM3e at 4,800 GB/s; NVLink 4; up to 700 W.
    _gpu("H200", peaks_tflops={"fp32": 67, "tf32": 494.5, "bf16": 989, "fp16": 989, "fp8": 1979}, memory_gb=141,
         bandwidth_GBps=4800, link="NVLink4", link_GBps=450, source="NVIDIA H200 product page", sm_count=132,
         watts=700, idle_watts=H200_IDLE_W),
    # NVIDIA HGX B200 pages (per GPU, dense): 80 fp32, ~1,100 tf32, 2,250 bf16/fp16, 4,500 fp8;
    # ~180 GB usable HBM3e at 8 TB/s; NVLink 5 at 900 GB/s per direction.
    _gpu("B200", peaks_tflops={"fp32": 80, "tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500}, memory_gb=180,
         bandwidth_GBps=8000, link="NVLink5", link_GBps=900, source="NVIDIA HGX B200 pages",
         efficiency={"gemm": 0.78}, sm_count=148, watts=1000),
    # NVIDIA L40S datasheet (dense): 91.6 fp32, 183 tf32, 362 bf16/fp16, 733 fp8; 48 GB GDDR6 at
    # 864 GB/s; no NVLink, PCIe Gen4 x16 (32 GB/s per direction).
    _gpu("L40S", peaks_tflops={"fp32": 91.6, "tf32": 183, "bf16": 362, "fp16": 362, "fp8": 733}, memory_gb=48,
         bandwidth_GBps=864, link="PCIe4", link_GBps=32, source="NVIDIA L40S datasheet", sm_count=142,
         watts=350),
    # AMD Instinct MI300X datasheet (dense): 163.4 fp32 matrix, 653.7 tf32, 1,307.4 bf16/fp16,
    # 2,614.9 fp8; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links of 64 GB/s per direction to
    # the node's other GPUs (448 GB/s). GEMM efficiency is lower in practice than on NVIDIA
    # parts (ml-engineering's matmul table: ~60% with the vendor BLAS).
    _gpu("MI300X", peaks_tflops={"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
         memory_gb=192, bandwidth_GBps=5300, link="InfinityFabric", link_GBps=448, source="AMD MI300X datasheet",
         efficiency={"gemm": 0.60}, sm_count=304, watts=750),
    # A CPU "device": one gloo rank per process on a small x86 host. Orders of magnitude only
    # (~50 GFLOP/s fp32 GEMM per rank with its share of the cores, ~10 GB/s of memory
    # bandwidth, ~20 µs per eager op); `autopar calibrate` replaces them with measurements.
    # Efficiencies are 1.0 because calibration measures achieved, not peak, rates.
    _gpu("cpu", peaks_tflops={"fp32": 0.05, "bf16": 0.01, "fp16": 0.01}, memory_gb=24, bandwidth_GBps=10,
         link="shared-memory", link_GBps=2, source="rough figures for a 2-core x86 host", memory_gib=True,
         efficiency={name: 1.0 for name in DEFAULT_EFFICIENCY}),
)}
CATALOGUE["cpu"] = CATALOGUE["cpu"].with_overrides(launch_overhead_s=20e-6)


def scale_family(gpu_name: str) -> str | None:
    """The COMPUTE_TIME_SCALE family a GPU belongs to ("A100-80GB" -> "A100"), None if unfitted."""
    return next((family for family in UNSCALED_EFFICIENCY if gpu_name.startswith(family)), None)


def with_compute_scale(gpu: GPUSpec, scale: float) -> GPUSpec:
    """The GPU with its family's fitted scale replaced by `scale` (1.0: the lone kernel's
    efficiency, nothing fitted); a GPU outside every fitted family is returned as is."""
    family = scale_family(gpu.name)
    if family is None:
        return gpu
    return gpu.with_overrides(efficiency={**gpu.efficiency, **_fitted(UNSCALED_EFFICIENCY[family], scale)})


def known_gpus() -> list[str]:
    return sorted(CATALOGUE)


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by name (case-insensitive), or fail naming the known ones."""
    for key, spec in CATALOGUE.items():
        if key.lower() == str(name).lower():
            return spec
    raise ValueError(f"Unknown GPU type '{name}'. Known types: {', '.join(known_gpus())}.")
