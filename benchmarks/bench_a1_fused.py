"""Megatron-LM's weak-scaling runs (shared PUBLISHED.md A1) priced on a fused-QKV GPT beside the
GPT with separate projections: the error against the published step time per row, for each.

examples/gpt_fused.py computes what examples/gpt.py computes, with q, k and v from one ``c_attn``
cut by ``split`` and viewed by the global head count (Megatron-LM's own layout). Before fused
projections were split as their parts, its tensor-parallel rows were predicted up to 2.6x slower
than published, because the priced plan replicated attention; split, both files must price the
same plan and land within the same error. Both are priced with a fused attention kernel (the rows'
written-out attention and dropouts left out, `ATTENTION_SETTINGS`): the layouts differ in their
projections only.

    python -m benchmarks.run a1_fused
"""
from __future__ import annotations

import json

from benchmarks import cases
from benchmarks.published.compare import load_runs, median_abs, price

LAYOUTS = {"separate q/k/v": "gpt.py", "fused qkv": "gpt_fused.py"}
ATTENTION_SETTINGS = ("attention", "attention_dropout", "hidden_dropout")  # examples/gpt.py's alone


def run() -> list[dict]:
    rows, errors = [], {name: [] for name in LAYOUTS}
    for published in cases([r for r in load_runs() if r["table"] == "A1"]):
        row = {"id": published["id"], "tp": published["plan"].get("tp", 1)}
        for name, file in LAYOUTS.items():
            model = {key: value for key, value in published["model"].items() if key not in ATTENTION_SETTINGS}
            compared = price({**published, "model": {**model, "file": file}})
            errors[name].append(compared.error)
            row[f"{name}: predicted_s"] = round(compared.predicted_step_s, 3)
            row[f"{name}: error"] = f"{compared.error:+.1%}"
        row["measured_s"] = round(compared.measured_step_s, 3)
        rows.append(row)
    rows.append({"id": "median |error|",
                 **{f"{name}: error": f"{median_abs(found):.1%}" for name, found in errors.items()}})
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
