"""GPU catalogue: dense peak FLOP/s per dtype, memory size and bandwidth, intra-node link.

Every number is a vendor datasheet figure for dense math (no sparsity); sources per entry.
Achievable fractions (`efficiency`) default to measured matmul results (stas00/ml-engineering,
"Maximum Achievable Matmul FLOPS": A100 87%, H100 80%, B200 78%) and are what calibration
overwrites.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

TERA = 1e12
GB = 1e9
GiB = 2**30

DEFAULT_EFFICIENCY = {
    # Fraction of peak FLOP/s (gemm, attention) or of memory bandwidth (the rest) reached.
    "gemm": 0.80, "attention": 0.55, "elementwise": 0.70, "norm": 0.60, "reduction": 0.60,
    "memory": 0.70, "other": 0.50, "view": 1.0,
}


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type.

    Attributes:
        peak_flops: dense peak FLOP/s per dtype name (fp32, tf32, bf16, fp16, fp8).
        memory_bytes: device memory (HBM) in bytes.
        memory_bandwidth_Bps: device memory bandwidth, bytes per second.
        intra_node_link: interconnect between GPUs of one node.
        intra_node_bandwidth_GBps: per-GPU unidirectional bandwidth on that link.
        efficiency: achievable fraction per op class (see DEFAULT_EFFICIENCY).
        launch_overhead_s: fixed time per kernel launch.
        source: where the numbers come from.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth_Bps: float
    intra_node_link: str
    intra_node_bandwidth_GBps: float
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    launch_overhead_s: float = 9e-6  # eager PyTorch per-op cost, fitted to H100 runs (benchmarks/measured)
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype; fp16 falls back to bf16 and vice versa."""
        for name in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise KeyError(f"{self.name} has no {dtype} peak")

    def with_overrides(self, **changes) -> "GPUSpec":
        return replace(self, **changes)


def _gpu(name: str, fp32: float, tf32: float | None, bf16: float, fp8: float | None, memory_gb: float,
         bandwidth_GBps: float, link: str, link_GBps: float, source: str, memory_gib: bool = False,
         efficiency: dict[str, float] | None = None) -> GPUSpec:
    peaks = {"fp32": fp32 * TERA, "bf16": bf16 * TERA, "fp16": bf16 * TERA}
    if tf32:
        peaks["tf32"] = tf32 * TERA
    if fp8:
        peaks["fp8"] = fp8 * TERA
    eff = dict(DEFAULT_EFFICIENCY)
    eff.update(efficiency or {})
    return GPUSpec(name=name, peak_flops=peaks, memory_bytes=int(memory_gb * (GiB if memory_gib else GB)),
                   memory_bandwidth_Bps=bandwidth_GBps * GB, intra_node_link=link, intra_node_bandwidth_GBps=link_GBps,
                   efficiency=eff, source=source)


CATALOGUE: dict[str, GPUSpec] = {spec.name: spec for spec in (
    # NVIDIA V100 datasheet (SXM2 32GB): 15.7 fp32, 125 fp16 tensor TFLOP/s; 900 GB/s; NVLink 2.
    _gpu("V100-32GB", 15.7, None, 125, None, 32, 900, "NVLink2", 150, "NVIDIA V100 datasheet"),
    # NVIDIA A100 datasheet (SXM): 19.5 fp32, 156 tf32, 312 bf16; 1,555 / 2,039 GB/s; NVLink 3.
    _gpu("A100-40GB", 19.5, 156, 312, None, 40, 1555, "NVLink3", 300, "NVIDIA A100 datasheet",
         efficiency={"gemm": 0.87}),
    _gpu("A100-80GB", 19.5, 156, 312, None, 80, 2039, "NVLink3", 300, "NVIDIA A100 datasheet",
         efficiency={"gemm": 0.87}),
    # NVIDIA H100 datasheet: SXM 67 fp32, 494.5 tf32, 989 bf16, 1,979 fp8; 3,350 GB/s; NVLink 4.
    _gpu("H100-SXM", 67, 494.5, 989, 1979, 80, 3350, "NVLink4", 450, "NVIDIA H100 datasheet"),
    # PCIe card: 51 fp32, 378 tf32, 756 bf16, 1,513 fp8; 2,000 GB/s; PCIe Gen5 x16 (64 GB/s).
    _gpu("H100-PCIe", 51, 378, 756, 1513, 80, 2000, "PCIe5", 64, "NVIDIA H100 datasheet"),
    # NVIDIA H200 page: H100 SXM compute, 141 GB at 4,800 GB/s.
    _gpu("H200", 67, 494.5, 989, 1979, 141, 4800, "NVLink4", 450, "NVIDIA H200 product page"),
    # NVIDIA HGX B200 pages: 80 fp32, ~1,100 tf32, 2,250 bf16, 4,500 fp8; ~180 GB usable at 8 TB/s.
    _gpu("B200", 80, 1100, 2250, 4500, 180, 8000, "NVLink5", 900, "NVIDIA HGX B200 pages",
         efficiency={"gemm": 0.78}),
    # NVIDIA L40S datasheet: 91.6 fp32, 183 tf32, 362 bf16, 733 fp8 (dense); 48 GB at 864 GB/s; PCIe4.
    _gpu("L40S", 91.6, 183, 362, 733, 48, 864, "PCIe4", 32, "NVIDIA L40S datasheet"),
    # AMD Instinct MI300X datasheet: 163.4 fp32, 653.7 tf32, 1,307.4 bf16, 2,614.9 fp8; 192 GB at
    # 5.3 TB/s; Infinity Fabric 7 x 64 GB/s links to the other GPUs of the node.
    _gpu("MI300X", 163.4, 653.7, 1307.4, 2614.9, 192, 5300, "InfinityFabric", 448, "AMD MI300X datasheet",
         efficiency={"gemm": 0.60}),
    # This 2-core CPU host: one gloo rank per process. Orders of magnitude only; run
    # `autopar calibrate` to replace them with measurements.
    _gpu("cpu", 0.05, None, 0.01, None, 24, 10, "shared-memory", 2, "rough figures for a 2-core x86 host",
         memory_gib=True, efficiency={"gemm": 1.0, "attention": 1.0, "elementwise": 1.0, "norm": 1.0,
                                      "reduction": 1.0, "memory": 1.0, "other": 1.0}),
)}


def known_gpus() -> list[str]:
    return sorted(CATALOGUE)


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by name (case-insensitive), or fail naming the known ones."""
    for key, spec in CATALOGUE.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"Unknown GPU type '{name}'. Known types: {', '.join(known_gpus())}.")
