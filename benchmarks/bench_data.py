"""`make demo`'s training run, measured: its losses, its step time, and data loading against what
training consumes, on CPU ranks.

The corpus is the standard library's `asyncio` sources (UTF-8 bytes, packed into sequences of the
planned length), as `make demo` reads it. Measured:
- the loader alone: one rank's DataLoader (its half of a global batch per step, in the global
  order, read by a worker process as runs do, and in the rank itself), in samples/s;
- the demo's run: examples/gpt.py compiled with `make demo`'s settings (`DEMO`, which
  tests/unit/test_docs_figures.py holds to the Makefile's) and trained by `autopar run` for its
  300 steps: the training loss at step 0, each validation loss, the median step, and the whole
  command's wall time (torchrun's start included). Each step's record says how long it ran
  (``step_time_s``) and how long it waited for its batch beyond what reading ahead hid
  (``data_wait_s``); the data's share of a step is wait / (wait + step), the median over the
  steps after the first (which starts the worker).

    python -m benchmarks.run data
"""
from __future__ import annotations

import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from statistics import median

from autopar.runtime.local import LOG_NAME, read_records
from autopar.sections import data as training_data
from autopar.sections import loader as data_loading
from benchmarks import sized, timed_autopar

REPO = Path(__file__).resolve().parent.parent
# `make demo`'s CPU compile, but for `data.path` (the same sources, copied).
DEMO = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "model.layers=4", "model.hidden=128", "model.heads=4",
        "model.seq_len=128", "model.vocab=257", "train.global_batch_size=16", "train.precision=fp32",
        "data.val_fraction=0.05", "train.eval_every=50", "optim.lr=3e-3", "optim.warmup_steps=30",
        "optim.min_lr=3e-4"]
DEMO_STEPS = 300
SEQ_LEN, GLOBAL_BATCH = 128, 16
STEPS, LOADER_STEPS = sized(DEMO_STEPS, 3), sized(200, 10)


def corpus_folder(root: Path) -> Path:
    """The asyncio package's sources: about half a megabyte of Python, on every machine."""
    target = root / "corpus"
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "asyncio", target,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


def loader_throughput(corpus: Path, cache: Path, workers: int) -> float:
    """Samples per second one rank's loader yields (half of every global batch)."""
    config = training_data.DataConfig(path=str(corpus), seq_len=SEQ_LEN, cache_dir=str(cache))
    train, _ = training_data.data_splits(config, min_samples=GLOBAL_BATCH)
    share = data_loading.Share(0, GLOBAL_BATCH // 2)
    loader = data_loading.rank_loader(train, seed=0, start=0, steps=LOADER_STEPS, global_batch=GLOBAL_BATCH,
                                      share=share, workers=workers)
    start = time.perf_counter()
    count = sum(batch[0].shape[0] for batch in loader)
    return count / (time.perf_counter() - start)


def demo_rows(corpus: Path, root: Path) -> list[dict]:
    """The demo compiled (check off: it does not change training) and trained for STEPS steps."""
    folder = root / "gpt_cpu"
    timed_autopar(["compile", str(REPO / "examples" / "gpt.py"), *DEMO, f"data.path={corpus}", "check=off",
                   "--out-dir", str(folder), "-q"], root)
    wall_s = timed_autopar(["run", str(folder), "--steps", str(STEPS)], root)
    records = read_records(folder / LOG_NAME)
    steps = [r for r in records if "loss" in r]
    later = steps[1:]
    wait, step = median(r["data_wait_s"] for r in later), median(r["step_time_s"] for r in later)
    rows = [{"measure": f"demo run: {len(steps)} steps on 2 ranks (median after the first)",
             "samples/s": f"{GLOBAL_BATCH / step:,.0f} consumed", "step_time_s": f"{step:.3f}",
             "data_wait_s": f"{wait:.5f}", "data share of the step": f"{wait / (wait + step):.2%}",
             "autopar run wall_s": f"{wall_s:.0f}"},
            {"measure": "demo run: training loss at step 0", "loss": f"{steps[0]['loss']:.2f}"}]
    rows += [{"measure": f"demo run: validation loss after {r['step']} steps", "loss": f"{r['val_loss']:.2f}"}
             for r in records if "val_loss" in r]
    return rows


def run() -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        corpus = corpus_folder(root)
        rows = [{"measure": f"loader alone, {w} worker(s)",
                 "samples/s": f"{loader_throughput(corpus, root / 'cache', w):,.0f}"}
                for w in (0, 1)]
        return rows + demo_rows(corpus, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
