"""`autopar` command line: ``autopar <verb> MODEL.py [key=value ...] [options]``.

Exit codes: 0 success, 1 a problem with the input (message says how to fix it), 2 an internal
error (a bug in autopar: the traceback is printed).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

from rich.console import Console

from autopar.errors import UserError

PROFILE_EXAMPLES = """examples:
  autopar profile examples/gpt.py
  autopar profile examples/gpt.py model.layers=24 model.hidden=2048 train.micro_batch_size=4
  autopar profile examples/llama_hf.py model.layers=80 model.hidden=8192 model.heads=64 \\
      model.kv_heads=8 model.ffn=28672 model.vocab=128256 model.seq_len=4096 --out profile.json
"""


ESTIMATE_EXAMPLES = """examples:
  autopar estimate examples/gpt.py cluster=dgx_a100_80g cluster.nodes=64 plan.tp=8 plan.pp=2 \\
      plan.zero_stage=1 plan.micro_batch_size=4 plan.recompute=full plan.schedule=interleaved_1f1b \\
      plan.chunks=2 train.global_batch_size=1536 model.layers=48 model.hidden=6144 model.heads=48 \\
      model.seq_len=2048 model.vocab=50257 --out estimate.json
  autopar estimate examples/gpt.py cluster=dgx_h100 cluster.inter_node_bandwidth_GBps=12.5 plan.tp=8
"""

PLAN_EXAMPLES = """examples:
  autopar plan examples/gpt.py cluster=dgx_a100_80g cluster.nodes=4 train.global_batch_size=256
  autopar plan examples/llama_hf.py cluster=dgx_h100 cluster.nodes=64 plan.tp=8 --top-k 5 --out plan.json
  autopar plan examples/gpt.py solver.objective=memory solver.time_limit_s=30 --report report/
  # a sweep (Hydra multirun): one plan per point, sweep.csv + sweep.md + sweep.png in --out-dir
  autopar plan examples/gpt.py -m cluster.nodes=1,2,4,8,16 cluster=dgx_a100_80g,dgx_h100 \\
      train.global_batch_size=512 --out-dir sweeps/gpt
"""

REPORT_EXAMPLES = """examples:
  autopar report out/gpt                  # re-render the report of a compiled folder
  autopar report plan.json --out-dir rep  # price a saved plan again and write its report
  autopar report plan.json --model path/to/model.py
"""


COMPILE_EXAMPLES = """examples:
  autopar compile examples/gpt.py cluster=dgx_h100 cluster.nodes=2 train.global_batch_size=256 --out-dir out/gpt
  autopar compile examples/gpt.py cluster=dgx_h100 cluster.nodes=2 --plan plan.json --out-dir out/gpt
  autopar compile examples/gpt.py cluster=cpu_gloo model.layers=2 model.hidden=64 model.heads=4 \\
      model.seq_len=32 model.vocab=128 train.global_batch_size=8 train.precision=fp32 --out-dir out/tiny
"""

RUN_EXAMPLES = """examples:
  autopar run out/tiny --steps 5
  autopar run out/tiny --nproc 4 --steps 20 --echo
  autopar run out/tiny --steps 100 --checkpoint-every 20 --max-restarts 3
"""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Options may sit between overrides (`plan MODEL -m a=1,2 b=3`): argparse leaves the overrides
    # after an option unparsed, so they are collected here.
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if item.startswith("-") or "=" not in item or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    # Piped output keeps wide tables readable instead of folding them at 80 columns.
    console = Console(quiet=args.quiet, width=None if sys.stdout.isatty() else 120)
    errors = Console(stderr=True)
    try:
        return args.handler(args, console)
    except UserError as err:
        errors.print(f"[bold red]error:[/] {err}", markup=True, highlight=False, soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - anything else is our bug: show everything
        errors.print("[bold red]internal error[/] (a bug in autopar; please report it with this output):")
        traceback.print_exc()
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Plan and compile parallel PyTorch training.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    _add_verb(verbs, "profile", "trace one training step and report FLOPs, bytes and memory per layer",
              PROFILE_EXAMPLES, _profile)
    _add_verb(verbs, "estimate", "predict step time, throughput, MFU and memory of one fixed plan (plan.*=...)",
              ESTIMATE_EXAMPLES, _estimate)
    plan = _add_verb(verbs, "plan", "search for the fastest plan that fits and explain the runners-up",
                     PLAN_EXAMPLES, _plan)
    plan.add_argument("--top-k", type=int, default=None, help="runners-up to show (solver.top_k)")
    plan.add_argument("--report", type=Path, default=None, metavar="DIR",
                      help="also write the plan report (report.html, report.md, timeline.json, ...) into DIR")
    plan.add_argument("-m", "--multirun", action="store_true",
                      help="sweep: plan every combination of the comma-separated overrides (Hydra multirun)")
    plan.add_argument("--out-dir", type=Path, default=None,
                      help="sweep output folder (default multirun/<date>/<time>)")
    compile_ = _add_verb(verbs, "compile", "profile, plan and write the parallel training module and launch scripts",
                         COMPILE_EXAMPLES, _compile, out=False)
    compile_.add_argument("--out-dir", type=Path, required=True,
                          help="folder for plan.json, parallel_<model>.py, launch.sh, sbatch.sh (replaced whole)")
    compile_.add_argument("--plan", type=Path, default=None,
                          help="reuse this saved plan instead of solving (must match the model file and cluster)")
    compile_.add_argument("--top-k", type=int, default=None, help="runners-up to show (solver.top_k)")
    report = _add_plain_verb(verbs, "report", "write the plan report (HTML, markdown, timeline) of a plan or compiled folder",
                             "Render report.html (self-contained), report.md, timeline.json (Chrome trace) and figures "
                             "for a compiled folder or a plan.json.", REPORT_EXAMPLES, _report)
    report.add_argument("source", type=Path, metavar="PLAN_OR_DIR", help="a folder `autopar compile` wrote, or a plan.json")
    report.add_argument("--out-dir", type=Path, default=None,
                        help="where to write (default: the folder itself, or the plan file's folder)")
    report.add_argument("--model", type=Path, default=None,
                        help="the model.py, when it is no longer where the plan says (re-pricing a plan.json)")
    validate = _add_plain_verb(verbs, "validate", "run a compiled folder a few steps and compare predictions with "
                               "measurements", "Train DIR's plan on local ranks for a few steps; per rank, print predicted "
                               "vs measured step time, its compute/communication split and peak memory, and write "
                               "DIR/validate.json (input of `autopar calibrate --from`).",
                               "examples:\n  autopar validate out/tiny --steps 6\n"
                               "  autopar calibrate --from out/tiny/validate.json --out hw.yaml", _validate)
    validate.add_argument("out_dir", type=Path, metavar="DIR", help="folder `autopar compile` wrote")
    validate.add_argument("--steps", type=int, default=5, help="timed steps (2 warm-up steps are not counted)")
    run = _add_plain_verb(verbs, "run", "run a compiled folder on local ranks (gloo on CPU, NCCL on GPUs)",
                          "Launch DIR/parallel_<model>.py with torchrun on this machine; one JSON record per step is "
                          "appended to DIR/run.jsonl.", RUN_EXAMPLES, _run)
    run.add_argument("out_dir", type=Path, metavar="DIR", help="folder `autopar compile` wrote")
    run.add_argument("--nproc", type=int, default=None, help="local ranks (default and only choice: the plan's world size)")
    run.add_argument("--steps", type=int, default=None, help="training steps (default: the module's own)")
    run.add_argument("--echo", action="store_true", help="print the ranks' output as it comes")
    run.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                     help="checkpoint every N steps into DIR/checkpoints and resume from the latest complete one")
    run.add_argument("--max-restarts", type=int, default=0, metavar="K",
                     help="restart all ranks up to K times after one fails (torchrun --max-restarts)")
    run.add_argument("--allow-fresh-start", action="store_true",
                     help="when checkpoints exist but none is usable (checksums do not match), train from step 0 "
                          "instead of failing")
    calibrate = _add_plain_verb(verbs, "calibrate", "measure this machine (or refit to measured runs) into a hardware "
                                "profile", "Measure GEMM throughput, memory bandwidth and the collectives' latency/"
                                "bandwidth of local ranks, or (--from) fit correction factors to `autopar validate` "
                                "results; write a hardware profile.",
                                "examples:\n  autopar calibrate --out hw.yaml\n"
                                "  autopar estimate examples/gpt.py cluster=calibrated plan.dp=4\n"
                                "  autopar calibrate --from out/a/validate.json out/b/validate.json --out hw.yaml",
                                _calibrate)
    calibrate.add_argument("--out", type=Path, default=Path("hw.yaml"), help="hardware profile to write")
    calibrate.add_argument("--ranks", type=int, default=2, help="local ranks for the all-reduce measurement")
    calibrate.add_argument("--ranks-per-node", type=int, default=4,
                           help="training ranks sharing this host's cores (cpu_gloo's gpus_per_node)")
    calibrate.add_argument("--gpu", default="cpu", help="catalogue entry the measurements replace")
    calibrate.add_argument("--from", dest="validations", type=Path, nargs="+", default=None, metavar="VALIDATE_JSON",
                           help="instead of measuring kernels, refit the cost model to these `autopar validate` "
                                "results (compute and per-collective correction factors)")
    calibrate.add_argument("--base", type=Path, default=None,
                           help="with --from: the hardware profile the runs were priced with (kept, factors added)")
    return parser


def _add_plain_verb(verbs: argparse._SubParsersAction, name: str, help_text: str, description: str, examples: str,
                    handler: Callable[[argparse.Namespace, Console], int]) -> argparse.ArgumentParser:
    """A verb that takes no model file: its parser with -v/-q; the caller adds its arguments."""
    sub = verbs.add_parser(name, help=help_text, description=description, epilog=examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("-v", "--verbose", action="store_true", help="print more detail")
    sub.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    sub.set_defaults(handler=handler)
    return sub


def _add_verb(verbs: argparse._SubParsersAction, name: str, help_text: str, examples: str,
              handler: Callable[[argparse.Namespace, Console], int], out: bool = True) -> argparse.ArgumentParser:
    sub = verbs.add_parser(name, help=help_text, description=help_text, epilog=examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("model", help="path of the model.py (defines build_model and example_batch)")
    sub.add_argument("overrides", nargs="*", metavar="key=value",
                     help="Hydra overrides: model.<kwarg>=..., train.<field>=..., cluster=<preset>, ...")
    if out:
        sub.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")
    sub.add_argument("-v", "--verbose", action="store_true", help="print more detail")
    sub.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    sub.set_defaults(handler=handler)
    return sub


def _profile(args: argparse.Namespace, console: Console) -> int:
    from autopar.config import compose_config
    from autopar.driver import run_profile
    from autopar.report.terminal import print_profile

    cfg = compose_config(args.overrides)
    with console.status(f"Tracing one training step of {args.model} on fake tensors ..."):
        profile = run_profile(args.model, cfg)
    print_profile(profile, console)
    if args.verbose:
        for entry in profile.coverage:
            console.print(f"  {entry.op:50s} {entry.op_class:12s} ×{entry.count:<6d} {entry.costed_by}")
    if args.out is not None:
        write_atomically(args.out, profile.to_json())
        console.print(f"wrote {args.out}")
    return 0


def _estimate(args: argparse.Namespace, console: Console) -> int:
    import json

    from autopar.config import compose_config
    from autopar.driver import run_estimate
    from autopar.report.terminal import print_estimate

    cfg = compose_config(args.overrides)
    with console.status("Tracing and pricing ..."):
        profile, layout, estimate = run_estimate(args.model, cfg)
    print_estimate(profile, layout, estimate, console)
    if args.out is not None:
        write_atomically(args.out, json.dumps(estimate.to_dict(), indent=1))
        console.print(f"wrote {args.out}")
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    from autopar.config import compose_config
    from autopar.driver import report_of, run_plan
    from autopar.report.terminal import print_plan

    overrides = list(args.overrides) + ([f"solver.top_k={args.top_k}"] if args.top_k is not None else [])
    if args.multirun:
        return _sweep(args, overrides, console)
    cfg = compose_config(overrides)
    with console.status("Tracing, pricing and solving ...") as status:
        def progress(done: int, total: int) -> None:
            status.update(f"Solving: candidate {done} of {total} in bound order ...")
        result = run_plan(args.model, cfg, progress=progress)
    print_plan(result, console)
    out = args.out or Path("plan.json")
    write_atomically(out, result.plan.to_json())
    console.print(f"wrote {out}")
    if args.report is not None:
        with console.status("Writing the report ..."):
            files = write_report_atomically(report_of(result), args.report)
        console.print(f"wrote {files['report.html']} (and report.md, timeline.json)")
    return 0


def _sweep(args: argparse.Namespace, overrides: list[str], console: Console) -> int:
    import time

    from rich.progress import Progress

    from autopar.sweep import run_sweep
    from autopar.report.terminal import print_sweep

    out_dir = args.out_dir or Path("multirun") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("Sweeping", total=None)

        def on_point(point, total: int) -> None:
            progress.update(task, total=total, completed=point.index,
                            description=f"Planning point {point.index + 1} of {total}: {' '.join(point.swept)}")
        rows = run_sweep(args.model, overrides, out_dir, on_point=on_point)
    print_sweep(rows, console)
    console.print(f"wrote {out_dir / 'sweep.csv'}, {out_dir / 'sweep.md'}, {out_dir / 'sweep.png'}")
    return 0


def _report(args: argparse.Namespace, console: Console) -> int:
    from autopar.driver import read_plan, rebuild_report
    from autopar.report.document import load_report

    source: Path = args.source
    if source.is_dir():
        saved, plan_file, out_dir = source / "report.json", source / "plan.json", args.out_dir or source
    else:
        saved, plan_file, out_dir = None, source, args.out_dir or source.parent
    with console.status("Writing the report ...") as status:
        if saved is not None and saved.is_file() and args.model is None:
            try:
                report = load_report(saved)
            except Exception as err:  # noqa: BLE001 - any parse failure means the same thing
                raise UserError(f"{saved} is not a readable report ({type(err).__name__}).",
                                f"delete it to price {plan_file} again, or compile again.") from None
        else:
            plan = read_plan(plan_file)
            status.update("Tracing the model and pricing the plan again ...")
            report = rebuild_report(plan, args.model)
        files = write_report_atomically(report, out_dir)
    console.print(f"wrote {files['report.html']}, {files['report.md']}, {files['timeline.json']}")
    return 0


def _compile(args: argparse.Namespace, console: Console) -> int:
    from autopar.config import compose_config
    from autopar.driver import run_compile
    from autopar.report.terminal import print_plan

    overrides = list(args.overrides) + ([f"solver.top_k={args.top_k}"] if args.top_k is not None else [])
    cfg = compose_config(overrides)
    with console.status("Tracing, pricing and solving ..." if args.plan is None else "Generating ...") as status:
        def progress(done: int, total: int) -> None:
            status.update(f"Solving: candidate {done} of {total} in bound order ...")
        plan, result, files = run_compile(args.model, cfg, args.out_dir, args.plan, progress=progress)
    if result is not None:
        print_plan(result, console)
    else:
        console.print(f"reused {args.plan}: dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} "
                      f"ZeRO-{plan.zero_stage}, predicted {plan.predicted.step_time_s:.3g} s/step")
    console.print(f"wrote {', '.join(str(path) for path in files.values())}")
    console.print(f"run it here with `autopar run {args.out_dir}`, on the cluster with {files['launch']}")
    return 0


def _run(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from autopar.driver import read_plan
    from autopar.runtime import run_local

    for option, value, lowest in (("--steps", args.steps, 1), ("--checkpoint-every", args.checkpoint_every, 1),
                                  ("--max-restarts", args.max_restarts, 0)):
        if value is not None and value < lowest:
            raise UserError(f"{option} {value} is out of range: it must be an integer >= {lowest}.",
                            f"pass {option} {lowest} or more.")
    plan = read_plan(args.out_dir / "plan.json")
    if args.nproc is not None and args.nproc != plan.world_size:
        raise UserError(f"{args.out_dir} was compiled for {plan.world_size} ranks, not {args.nproc}.",
                        f"run it with --nproc {plan.world_size} (or omit --nproc), or compile again for "
                        f"{args.nproc} GPUs.")
    with console.status(f"Running {plan.world_size} local ranks ..."):
        extra = ["--checkpoint-every", str(args.checkpoint_every)] if args.checkpoint_every is not None else []
        extra += ["--allow-fresh-start"] if args.allow_fresh_start else []
        result = run_local(args.out_dir, plan.world_size, args.steps, extra_args=extra, echo=args.echo,
                           max_restarts=args.max_restarts)
    for warning in result.warnings:  # shown with or without --echo
        console.print(warning, markup=False)
    if result.teardown_failure is not None:
        console.print(f"note: every rank finished and wrote its results, then one died while shutting down "
                      f"(torchrun exit {result.teardown_failure}); the run counts as finished", markup=False)
    if not result.ok:
        where = f"rank {result.failed_rank}" if result.failed_rank is not None else "a rank"
        raise UserError(f"The run failed on {where} (exit {result.returncode}):\n{result.error}",
                        "fix the error above (rerun with --echo for every rank's output).")
    table = Table("step", "loss", "step time", "tokens/s", "peak memory")
    for record in result.records:
        table.add_row(str(record["step"]), f"{record['loss']:.5f}", f"{record['step_time_s'] * 1e3:.1f} ms",
                      f"{record['tokens_per_s']:,.0f}", f"{record['peak_memory_bytes'] / 2**20:,.1f} MiB")
    console.print(table)
    console.print(f"appended {len(result.records)} records to {args.out_dir / 'run.jsonl'}")
    return 0


def _validate(args: argparse.Namespace, console: Console) -> int:
    from autopar.report.terminal import print_validation
    from autopar.runtime.validate import validate

    with console.status(f"Running and measuring {args.out_dir} ..."):
        result = validate(args.out_dir, steps=args.steps)
    print_validation(result, console)
    console.print(f"wrote {args.out_dir / 'validate.json'}")
    return 0


def _calibrate(args: argparse.Namespace, console: Console) -> int:
    if args.validations:
        return _calibrate_from_runs(args, console)
    from cost_models.calibrate import calibrate

    with console.status("Measuring GEMM, memory bandwidth and all-reduce ..."):
        profile = calibrate(args.out, gpu_name=args.gpu, ranks=args.ranks, ranks_per_node=args.ranks_per_node)
    gpu = profile["gpus"][args.gpu]
    link = profile["links"]["intra"]
    console.print(f"GEMM {max(gpu['peak_flops'].values()) / 1e9:,.1f} GFLOP/s per rank, memory "
                  f"{gpu['memory_bandwidth_Bps'] / 1e9:,.1f} GB/s, all-reduce link "
                  f"{link['bandwidth_Bps'] / 1e9:,.2f} GB/s with {link['latency_s'] * 1e6:,.0f} µs per message")
    console.print(f"wrote {args.out}; use it with cluster=calibrated cluster.hardware_profile={args.out}")
    return 0


def _calibrate_from_runs(args: argparse.Namespace, console: Console) -> int:
    import json

    from cost_models.feedback import fit_time_scale, write_profile

    runs = []
    for path in args.validations:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise UserError(f"{path} is not a readable validate.json ({type(err).__name__}).",
                            "pass files written by `autopar validate DIR`.") from None
    scale = fit_time_scale(runs)
    write_profile(scale, args.out, args.base, [str(path) for path in args.validations])
    console.print("fitted factors (measured / predicted): " + ", ".join(f"{k} {v:.3g}" for k, v in scale.items()))
    console.print(f"wrote {args.out}; price with it: cluster.hardware_profile={args.out}")
    return 0


def write_report_atomically(report, out_dir: Path) -> dict[str, Path]:
    """Render into a staging folder, then move the files in, so a failure leaves nothing half-written."""
    import shutil

    from autopar.report.render import write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=".report.", suffix=".partial"))
    try:
        files = write_report(report, staging)
        for path in files.values():
            os.replace(path, out_dir / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: out_dir / path.name for name, path in files.items()}


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, so a crash leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
