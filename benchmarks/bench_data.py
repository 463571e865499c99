"""Data loading against what training consumes, on CPU ranks.

Two measurements on a corpus of the standard library's own sources (UTF-8 bytes, packed into
sequences of the planned length):
- the loader alone: one rank's DataLoader (its share of a global batch per step, in the global
  order, read by a worker process as runs do, and in the rank itself), in samples/s;
- a training run: the tiny GPT compiled for 2 gloo ranks (dp2) trained on the corpus by
  `autopar run`; each step's record says how long the step ran (``step_time_s``) and how long it
  waited for its batch beyond what reading ahead hid (``data_wait_s``). The data's share of the
  step is wait / (wait + step) over the steps after the first (which starts the worker).

    python -m benchmarks.run data
"""
from __future__ import annotations

import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from statistics import median

from autopar.codegen import generate
from autopar.sections import data as training_data
from autopar.sections import loader as data_loading
from autopar.runtime import run_local
from benchmarks import sized
from tests.dist.plans import GLOBAL_BATCH, GPT, make_plan

SEQ_LEN, STEPS, LOADER_STEPS = 128, sized(30, 3), sized(200, 10)
KWARGS = {**GPT.kwargs, "vocab": 257, "seq_len": SEQ_LEN, "hidden": 128, "layers": 4}


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


def run() -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        corpus = corpus_folder(root)
        rows = [{"measure": f"loader alone, {w} worker(s)",
                 "samples/s": f"{loader_throughput(corpus, root / 'cache', w):,.0f}"}
                for w in (0, 1)]
        folder = root / "gpt"
        plan = make_plan(GPT, dp=2)
        generate(plan, GPT.path, folder, model_kwargs=KWARGS)
        result = run_local(folder, steps=STEPS, extra_args=["--data", f"path={corpus}"], timeout_s=600)
        if not result.ok:
            raise RuntimeError(result.error)
        steps = [r for r in result.records if "loss" in r][1:]
        wait, step = median(r["data_wait_s"] for r in steps), median(r["step_time_s"] for r in steps)
        rows.append({"measure": f"training dp2 (median of {len(steps)} steps)",
                     "samples/s": f"{GLOBAL_BATCH / step:,.0f} consumed",
                     "step_time_s": f"{step:.4f}", "data_wait_s": f"{wait:.5f}",
                     "data share of the step": f"{wait / (wait + step):.2%}"})
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
