"""The generated ring attention keeps, for backward, what the cost model prices for it.

One rank of a cp-rank ring runs on torch's fake process group (the other ranks' blocks are
never sent: only what this rank keeps is counted), in a fresh interpreter so the group does
not outlive the test. Every tensor autograd saves is recorded by storage; the caller's q, k, v
are left out (the profile prices them with the ops that made them).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.memory import ring_attention_extra_bytes

REPO = Path(__file__).resolve().parents[2]

MEASURE = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
cp, heads, kv_heads = (int(a) for a in sys.argv[1:4])
dist.init_process_group("fake", rank=0, world_size=cp, store=FakeStore())
from autopar.sections.context_parallel import ring_attention
batch, local, dim = 1, 512, 64
q = torch.randn(batch, heads, local, dim, dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(batch, kv_heads, local, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
saved = {}
def keep(t):
    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
    ring_attention(q, k, v, dist.group.WORLD, local * cp, True, None)
own = {t.untyped_storage().data_ptr() for t in (q, k, v)}
print(json.dumps({"kept": sum(n for p, n in saved.items() if p not in own),
                  "q": q.numel() * 2, "kv": (k.numel() + v.numel()) * 2}))
"""


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 8, 8), (4, 8, 2)])
def test_ring_attention_keeps_what_the_cost_model_prices(cp, heads, kv_heads):
    """(4cp - 1) fp32 query-sized tensors (queries, cp expanded K/V blocks, the merges' outputs)
    in place of the profiled bf16 queries, keys, values and output; within the log-sum-exps
    (one fp32 number per query and head a tensor, 1/64 of a query at head dim 64)."""
    run = subprocess.run([sys.executable, "-c", MEASURE, str(cp), str(heads), str(kv_heads)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    profiled = 2 * measured["q"] + measured["kv"]  # bf16 q, k, v and output, as SDPA keeps them
    priced = ring_attention_extra_bytes(measured["q"], measured["kv"], cp, 2) + profiled
    assert priced <= measured["kept"] <= priced * 1.04
