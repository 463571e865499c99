"""Grouped GEMMs (mixture-of-experts layers) on fake tensors: their FLOPs and their fp32 shapes.

Hugging Face's MoE layers (Mixtral, Qwen2-MoE, DeepSeek-V3, ...) run their experts as one
``aten._grouped_mm``: each routed token's row multiplied by its expert's matrix. Two gaps of
torch 2.13 stop us seeing it:

- ``torch.utils.flop_counter`` has no formula for it, so a profile counted none of the experts'
  work (Mixtral-8x7B's forward showed 20.9 TFLOP against Mistral-7B's 67).
- Its meta kernel copies the CUDA kernel's checks and refuses any dtype but bf16, while the CPU
  kernel (what a fp32 run here calls) takes fp32: a fp32 model that trains could not be traced.

The FLOPs are 2·M·K·N for every layout of the operands (2-D tokens x 3-D experts, the 2-D x 2-D
weight gradient, 3-D x 3-D): twice the first operand's elements times the second's last dim.
"""
from __future__ import annotations

import math
from typing import Any

import torch

_RELAXED_DTYPES = (torch.float32, torch.float16)


def grouped_mm_flop(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm`` from its operands' shapes (see the module docstring)."""
    return 2 * math.prod(a_shape) * b_shape[-1]


def allow_fp32_grouped_mm_on_fake_tensors() -> None:
    """Let the meta kernel of ``aten._grouped_mm`` shape fp32/fp16 operands as it shapes bf16 ones
    (idempotent). Private: torch has no public way to replace an ATen op's meta kernel, and the
    module function its registered kernel calls is the narrowest place to relax the check."""
    from torch import _meta_registrations as meta

    original = meta._meta_grouped_mm_common
    if getattr(original, "autopar_relaxed", False):
        return

    def relaxed(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: Any = None, scale_b: Any = None,
                offs: Any = None, bias: Any = None, scale_result: Any = None, out_dtype: Any = None,
                use_fast_accum: bool = False) -> torch.Tensor:
        if scale_a is None and scale_b is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in _RELAXED_DTYPES:
            shaped = original(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), None, None, offs=offs,
                              bias=bias, scale_result=scale_result, out_dtype=None, use_fast_accum=use_fast_accum)
            return shaped.to(out_dtype or mat_a.dtype)
        return original(mat_a, mat_b, scale_a, scale_b, offs=offs, bias=bias, scale_result=scale_result,
                        out_dtype=out_dtype, use_fast_accum=use_fast_accum)

    relaxed.autopar_relaxed = True  # type: ignore[attr-defined]
    meta._meta_grouped_mm_common = relaxed
