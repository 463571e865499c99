"""`autopar` command line: ``autopar <verb> MODEL.py [key=value ...] [options]``.

Exit codes: 0 success, 1 a problem with the input or the environment (a full disk, a read-only
folder, a command line argparse cannot read, a model file that ends the process; one paragraph says
how to fix it), 2 an internal error (a bug in autopar: the traceback is printed), 130 Ctrl-C
(SIGINT) and 143 SIGTERM. Both signals stop the work the same way: the processes it started are
stopped and its staging and temporary folders removed.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import os
import shlex
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NoReturn

from rich.console import Console
from rich.markup import escape

from autopar.emit import ENGINES
from autopar.errors import ConfigError, UserError
from autopar.output_dir import write_atomically
from autopar.user_code import TimeLimitReached, describe_exit, exits_refused

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
  autopar estimate examples/gpt.py cluster=dgx_h100 cluster.nodes=4 --from megatron_args.txt
"""

PLAN_EXAMPLES = """examples:
  autopar plan examples/gpt.py cluster=dgx_a100_80g cluster.nodes=4 train.global_batch_size=256
  autopar plan examples/llama_hf.py cluster=dgx_h100 cluster.nodes=64 plan.tp=8 --top-k 5 --out plan.json
  autopar plan examples/gpt.py solver.objective=memory solver.work_limit=30 --report report/
  autopar plan examples/gpt.py cluster=cpu_gloo --cfg job   # print the composed configuration
  # a sweep (Hydra multirun): one plan per point, sweep.csv + sweep.md + sweep.png in hydra.sweep.dir
  autopar plan examples/gpt.py -m cluster.nodes=1,2,4,8,16 cluster=dgx_a100_80g,dgx_h100 \\
      train.global_batch_size=512 hydra.sweep.dir=sweeps/gpt
  # in parallel processes, or one SLURM job per point
  autopar plan examples/gpt.py -m cluster.nodes=1,2,4,8 hydra/launcher=joblib hydra.launcher.n_jobs=4
  autopar plan examples/gpt.py -m cluster.nodes=8,16,32 hydra/launcher=submitit_slurm hydra.launcher.partition=cpu
  # Optuna: the cluster size with the lowest cost per million tokens, steps of at most 2 s
  autopar plan examples/gpt.py -m hydra/sweeper=optuna hydra.sweeper.n_trials=20 hydra.sweeper.direction=minimize \\
      'cluster.nodes=choice(1,2,4,8,16)' sweep.objective=cost_per_million_tokens sweep.max_step_time_s=2
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
  # every compile first trains the module one step at full scale on fake tensors; check=on|off|auto
  # (auto: on for a cluster of this machine's CPU ranks) adds 2 steps on local gloo ranks against one process
  autopar compile examples/gpt.py cluster=cpu_gloo check=off --out-dir out/tiny
"""

RUN_EXAMPLES = """examples:
  autopar run out/tiny --steps 5
  autopar run out/tiny --nproc 4 --steps 20 --echo
  autopar run out/tiny --steps 100 --checkpoint-every 20 --max-restarts 3
  autopar run out/llama --steps 100 --init-from llama_hf/ --export out_hf   (fine-tune a Hugging Face model)
"""


def main(argv: list[str] | None = None) -> int:
    errors = Console(stderr=True)
    try:
        args = parse_arguments(build_parser(), argv)
    except UsageError as err:
        _print_error(errors, str(err))
        return err.exit_code
    # Piped output keeps wide tables readable instead of folding them at 80 columns.
    console = Console(quiet=args.quiet, width=None if sys.stdout.isatty() else 120)
    try:
        # os._exit / os.exec* in the user's code raise instead (autopar/user_code.py)
        with sigterm_as_interrupt(), exits_refused():
            return args.handler(args, console)
    except UserError as err:
        _print_error(errors, str(err))
        return err.exit_code
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except OSError as err:
        # The environment, not autopar: a full disk, a read-only folder, a path that is a folder.
        if err.errno not in ENVIRONMENT_ERRNOS:
            raise
        _print_error(errors, environment_error_message(err, verb_options(args.verb)))
        return 1
    except Exception:  # noqa: BLE001 - anything else is our bug: show everything
        return _internal_error(errors)
    except BaseException as err:  # noqa: BLE001 - SystemExit, GeneratorExit, a user's own BaseException
        return _ended_early(err, errors)


class UsageError(UserError):
    """A command line argparse cannot read (exit 1 like every user error; argparse itself exits 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise `UsageError` (one paragraph, exit 1) instead of printing
    the usage and exiting 2, which autopar keeps for its own bugs."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}.", f"see `{self.prog} --help` for its arguments and examples.")


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The verb's arguments. Options may sit between overrides (`plan MODEL -m a=1,2 b=3`):
    argparse leaves the overrides after an option unparsed, so they are collected here."""
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra
             if item.startswith("-") or ("=" not in item and not item.startswith("~"))
             or not hasattr(args, "overrides")]
    if stray:
        prog = f"{parser.prog} {args.verb}" if getattr(args, "verb", None) else parser.prog
        raise UsageError(f"{prog}: unrecognized arguments: {' '.join(stray)}.",
                         f"see `{prog} --help` for its arguments and examples.")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def _print_error(errors: Console, message: str) -> None:
    errors.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)


def _internal_error(errors: Console) -> int:
    errors.print("[bold red]internal error[/] (a bug in autopar; please report it with this output):")
    traceback.print_exc()
    return 2


def _ended_early(err: BaseException, errors: Console) -> int:
    """Code autopar ran tried to end the process (sys.exit, os._exit, raise GeneratorExit or
    another BaseException) or ran past its bound: the user's code is named (exit 1); from
    autopar's own code it is a bug (exit 2)."""
    from autopar.model_file import EXIT_FIX
    from autopar.user_code import exit_origin, in_autopar

    frame = exit_origin(err)
    if frame is None or in_autopar(frame):
        return _internal_error(errors)
    if isinstance(err, TimeLimitReached):
        problem = f"{frame.filename}:{frame.lineno} (in {frame.name}) ran past autopar's bound of {err.seconds:g} s."
        _print_error(errors, f"{problem} Fix: make it finish sooner.")
        return 1
    where = f"{frame.filename}:{frame.lineno} (in {frame.name})"
    _print_error(errors, f"{where} {describe_exit(err, located=False)} while autopar ran it, so the command stopped "
                         f"before it had finished. Fix: {EXIT_FIX}")
    return 1


class Terminated(KeyboardInterrupt):
    """SIGTERM: handled wherever Ctrl-C is (children stopped, temporary folders removed)."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises `Terminated` once (a second one during the clean-up is
    ignored, so the clean-up finishes); the previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# errno -> (what happened, what to do); every other OSError is still reported as a bug.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: ("the disk is full", "free space on that disk (or write elsewhere) and run the command again; "
                                       "nothing was written half-way"),
    errno.EDQUOT: ("the disk quota is exhausted", "free space in your quota (or write elsewhere) and run again"),
    errno.EROFS: ("it is on a read-only file system", "write somewhere writable{elsewhere}"),
    errno.EACCES: ("permission is denied", "write somewhere you may write{elsewhere}, or fix the permissions"),
    errno.EPERM: ("the operation is not permitted", "write somewhere you may write{elsewhere}"),
    errno.EISDIR: ("it is a folder where a file was expected", "pass a file path, not a folder"),
    errno.ENOTDIR: ("part of the path is a file, not a folder", "pass a path whose folders are folders"),
    errno.EEXIST: ("something is already there", "remove it or choose another path"),
    errno.ENAMETOOLONG: ("the name is too long", "choose a shorter path"),
    errno.ENOENT: ("it does not exist", "check the path (a file or folder named in the command, or its folder)"),
}


# The options that choose where a verb writes; a fix names only those the verb has.
OUTPUT_OPTIONS = ("--out", "--out-dir", "--report")


def environment_error_message(err: OSError, options: Iterable[str] = ()) -> str:
    """One paragraph naming the path, the cause and the fix of an environment error; ``options``:
    the verb's options (the fix suggests its output options, or a copy of the folder it runs)."""
    assert err.errno is not None  # callers pass errors with one of ENVIRONMENT_ERRNOS
    what, fix = ENVIRONMENT_ERRNOS[err.errno]
    outputs = [option for option in OUTPUT_OPTIONS if option in set(options)]
    fix = fix.format(elsewhere=f" ({' / '.join(outputs)})" if outputs else
                     " (a copy of the folder in a place you may write)")
    path = err.filename if err.filename is not None else "a file"
    other = f" (moving it to {err.filename2})" if err.filename2 is not None else ""
    return f"{path}{other}: {what} ({os.strerror(err.errno)}). Fix: {fix}."


def verb_options(verb: str) -> list[str]:
    """Every option string of a verb (``--out``, ``-q``, ...), as its parser has them."""
    parser = build_parser()
    verbs = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return [option for action in verbs.choices[verb]._actions for option in action.option_strings]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="autopar", description="Plan and compile parallel PyTorch training.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    _add_verb(verbs, "profile", "trace one training step and report FLOPs, bytes and memory per layer",
              PROFILE_EXAMPLES, _profile)
    estimate = _add_verb(verbs, "estimate",
                         "predict step time, throughput, MFU and memory of one fixed plan (plan.*=...)",
                         ESTIMATE_EXAMPLES, _estimate)
    estimate.add_argument("--from", dest="from_file", type=Path, default=None, metavar="FILE",
                          help="price the settings of another engine's file (a DeepSpeed .json, an accelerate .yaml, "
                               "Megatron-LM or torchtitan arguments), beside the best plan that engine runs and the "
                               "best plan overall")
    plan = _add_verb(verbs, "plan", "search for the fastest plan that fits and explain the runners-up",
                     PLAN_EXAMPLES, _plan)
    plan.add_argument("--top-k", type=int, default=None, help="runners-up to show (solver.top_k)")
    plan.add_argument("--report", type=Path, default=None, metavar="DIR",
                      help="also write the plan report (report.html, report.md, timeline.json, ...) into DIR")
    plan.add_argument("-m", "--multirun", action="store_true",
                      help="sweep (Hydra multirun): plan every point of the sweep overrides through hydra/sweeper "
                           "and hydra/launcher")
    plan.add_argument("--out-dir", type=Path, default=None,
                      help="sweep output folder, the same as hydra.sweep.dir=DIR (default multirun/<date>/<time>)")
    compile_ = _add_verb(verbs, "compile", "profile, plan and write the parallel training module and launch scripts",
                         COMPILE_EXAMPLES, _compile, out=False)
    compile_.add_argument("--out-dir", type=Path, required=True,
                          help="folder for plan.json, parallel_<model>.py, launch.sh, sbatch.sh, the report; in an "
                               "existing folder only autopar's own files are replaced, everything else is kept")
    compile_.add_argument("--force", action="store_true",
                          help="also replace files in --out-dir that autopar did not write or that were edited")
    compile_.add_argument("--plan", type=Path, default=None,
                          help="reuse this saved plan instead of solving (must match the model file and cluster)")
    compile_.add_argument("--top-k", type=int, default=None, help="runners-up to show (solver.top_k)")
    for verb in (plan, compile_):
        verb.add_argument("--emit", action="append", default=[], choices=ENGINES, metavar="ENGINE",
                          help="also write the plan as that engine's settings beside plan.json (repeatable): "
                               "torchtitan, megatron, deepspeed, accelerate; a plan the engine cannot run is refused")
    report = _add_plain_verb(verbs, "report",
                             "write the plan report (HTML, markdown, timeline) of a plan or compiled folder",
                             "Render report.html (self-contained), report.md, timeline.json (Chrome trace) and figures "
                             "for a compiled folder or a plan.json.", REPORT_EXAMPLES, _report)
    report.add_argument("source", type=Path, metavar="PLAN_OR_DIR",
                        help="a folder `autopar compile` wrote, or a plan.json")
    report.add_argument("--out-dir", type=Path, default=None,
                        help="where to write (default: the folder itself, or the plan file's folder)")
    report.add_argument("--model", type=Path, default=None,
                        help="the model.py to price a plan.json again with (checked against the plan's sha256); "
                             "without it the model file named inside the plan is never imported")
    report.add_argument("--force", action="store_true",
                        help="replace report files in the folder that autopar did not write or that were edited")
    validate = _add_plain_verb(verbs, "validate",
                               "run a compiled folder a few steps and compare predictions with measurements",
                               "Train DIR's plan on local ranks for a few steps; per rank, print predicted "
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
    run.add_argument("--nproc", type=int, default=None,
                     help="local ranks (default and only choice: the plan's world size)")
    run.add_argument("--steps", type=int, default=None, help="training steps (default: the module's own)")
    run.add_argument("--echo", action="store_true", help="print the ranks' output as it comes")
    run.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                     help="checkpoint every N steps into DIR/checkpoints and resume from the latest complete one")
    run.add_argument("--max-restarts", type=int, default=0, metavar="K",
                     help="restart all ranks up to K times after one fails (torchrun --max-restarts)")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="training settings over the compiled ones: data.path=FILE (and the other data.* of the "
                          "text pipeline), train.eval_every=N, train.eval_batches=K, optim.lr=..., ...")
    run.add_argument("--no-tensorboard", action="store_true",
                     help="write no TensorBoard event files (default: DIR/tensorboard/<run id>/)")
    run.add_argument("--wandb", default=None, metavar="PROJECT",
                     help="also log the metrics to this Weights & Biases project (pip install wandb)")
    run.add_argument("--mlflow", default=None, metavar="EXPERIMENT",
                     help="also log the metrics to this MLflow experiment (pip install mlflow)")
    run.add_argument("--allow-fresh-start", action="store_true",
                     help="when checkpoints exist but none is usable (checksums do not match), train from step 0 "
                          "instead of failing")
    run.add_argument("--init-from", type=Path, default=None, metavar="PATH",
                     help="start from these weights: a .safetensors file, a Hugging Face model folder, or a torch "
                          "state dict file (names and shapes must match the model; a resumed checkpoint wins)")
    run.add_argument("--export", type=Path, default=None, metavar="PATH",
                     help="write the trained weights: one file for PATH.safetensors / PATH.pt, else a folder "
                          "(model.safetensors, and config.json for a Hugging Face model)")
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
    from autopar.hydra_app import config_help

    sub = verbs.add_parser(name, help=help_text, description=help_text,
                           epilog=f"{examples}\n{config_help().text()}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("model", help="path of the model.py (defines build_model and example_batch)")
    sub.add_argument("overrides", nargs="*", metavar="key=value",
                     help="Hydra overrides: model.<kwarg>=..., train.<field>=..., cluster=<preset>, "
                          "+key=value, ~key, hydra.<setting>=...")
    if out:
        sub.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")
    sub.add_argument("-c", "--cfg", choices=("job", "hydra", "all"), default=None,
                     help="print the composed configuration (job: autopar's, hydra: Hydra's, all) and stop")
    sub.add_argument("--info", nargs="?", const="all", default=None,
                     choices=("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
                     help="print Hydra's information about the configuration and stop")
    sub.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations first")
    sub.add_argument("-p", "--package", default=None, help="with --cfg: print only this part, e.g. cluster")
    sub.add_argument("-v", "--verbose", action="store_true", help="print more detail")
    sub.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    sub.set_defaults(handler=handler)
    return sub


def _hydra_overrides(args: argparse.Namespace, verb: str, defaults: Mapping[str, str | Path],
                     extra: list[str] | None = None) -> list[str]:
    """The verb's overrides as Hydra gets them, checked first (in autopar's words, before torch is
    imported, so a typo costs a fraction of a second); ``defaults`` are hydra.* settings the
    verb uses unless the user set them."""
    from autopar import hydra_app
    from autopar.config import compose_config

    overrides = hydra_app.with_defaults(verb, list(args.overrides) + (extra or []), defaults)
    compose_config(overrides, hydra=True)
    return overrides


def _show_requested(args: argparse.Namespace) -> bool:
    return args.cfg is not None or args.info is not None


def _show(args: argparse.Namespace, overrides: list[str]) -> int:
    from autopar import hydra_app

    flags = hydra_app.HydraFlags(cfg=args.cfg, info=args.info, resolve=args.resolve, package=args.package)
    # Hydra printed its own message when it failed: whatever code it chose, that is exit 1.
    return 0 if hydra_app.show(flags, overrides) == 0 else 1


def _run_job(args: argparse.Namespace, job: Callable[[Any], Any], overrides: list[str]) -> Any:
    """Run ``job(cfg)`` as a Hydra job in this process; what it raised is raised here. Under
    hydra.job.chdir=true the job runs inside its output folder, so the paths given on the command
    line are made absolute first (as hydra.utils.to_absolute_path would)."""
    from autopar import hydra_app

    if any(item.replace(" ", "").lower() == "hydra.job.chdir=true" for item in overrides):
        for name in ("model", "out", "out_dir", "plan", "report"):
            value = getattr(args, name, None)
            if value is not None:
                setattr(args, name, type(value)(Path(value).resolve()))
    outcome = hydra_app.run(job, overrides)
    if outcome.error is not None:
        raise outcome.error
    return outcome


# Verbs whose output is a file the user names (or none): Hydra's run folder is the current one
# and Hydra writes nothing into it (compile keeps `.hydra/` in the folder it compiles).
NO_RUN_FOLDER = {"hydra.run.dir": ".", "hydra.output_subdir": "null"}


def _profile(args: argparse.Namespace, console: Console) -> int:
    overrides = _hydra_overrides(args, "profile", NO_RUN_FOLDER)
    if _show_requested(args):
        return _show(args, overrides)
    _check_out(args)

    def job(cfg: Any) -> None:
        from autopar.driver import run_profile
        from autopar.report.terminal import print_profile

        with console.status(f"Tracing one training step of {args.model} on fake tensors ..."):
            profile = run_profile(args.model, cfg)
        print_profile(profile, console)
        if args.verbose:
            for entry in profile.coverage:
                console.print(f"  {entry.op:50s} {entry.op_class:12s} ×{entry.count:<6d} {entry.costed_by}")
        if args.out is not None:
            write_atomically(args.out, profile.to_json())
            console.print(f"wrote {args.out}")

    _run_job(args, job, overrides)
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """Refuse an --out that cannot be written before tracing, not after."""
    from autopar.output_dir import check_out_file

    if args.out is not None:
        check_out_file(args.out)


def _estimate(args: argparse.Namespace, console: Console) -> int:
    settings = None
    if args.from_file is not None:
        from autopar.emit import read_engine_file

        settings = read_engine_file(args.from_file)  # its settings follow (and win over) the command line's
    overrides = _hydra_overrides(args, "estimate", NO_RUN_FOLDER, settings.overrides() if settings else None)
    if _show_requested(args):
        return _show(args, overrides)
    _check_out(args)

    def job(cfg: Any) -> None:
        import json

        from autopar.driver import run_estimate
        from autopar.report.terminal import print_estimate

        if settings is not None:
            from autopar.emit import check_engine_file
            from autopar.specs import build_cluster

            check_engine_file(settings, build_cluster(cfg).world_size, args.from_file)
            for note in settings.notes:
                console.print(f"{settings.engine}: {note}", markup=False, highlight=False, soft_wrap=True)
        with console.status("Tracing and pricing ..."):
            profile, layout, estimate = run_estimate(args.model, cfg)
        print_estimate(profile, layout, estimate, console)
        if settings is not None:
            _compare_with_best(args, cfg, settings, profile, estimate, console)
        if args.out is not None:
            write_atomically(args.out, json.dumps(estimate.to_dict(), indent=1))
            console.print(f"wrote {args.out}")

    _run_job(args, job, overrides)
    return 0


def _compare_with_best(args: argparse.Namespace, cfg: Any, settings: Any, profile: Any, estimate: Any,
                       console: Console) -> None:
    """`estimate --from`: the file's price beside the best plan its engine runs and the best plan."""
    import copy

    from omegaconf import OmegaConf

    from autopar.driver import run_plan

    free = copy.deepcopy(cfg)  # the same settings with the file's plan.* choices left to the search
    for key in settings.pins:
        if key.startswith("plan."):
            OmegaConf.update(free, key, None)
    engine_cfg = copy.deepcopy(free)
    OmegaConf.update(engine_cfg, "plan.engine", settings.engine)
    rows = [(f"your config ({args.from_file.name}, {settings.engine})", estimate.step_time_s)]
    with console.status(f"Planning the best {settings.engine} config and the best plan ..."):
        for label, planned_cfg in ((f"best {settings.engine} config", engine_cfg), ("best plan", free)):
            try:
                plan = run_plan(args.model, planned_cfg, profile=profile).plan
                rows.append((f"{label}: {plan.summary()}", plan.predicted.step_time_s))
            except UserError as err:
                rows.append((f"{label}: none ({err.problem})", None))
    yours = estimate.step_time_s
    for label, seconds in rows:
        gain = f" ({yours / seconds:.2f}x)" if seconds and label != rows[0][0] else ""
        shown = f"{seconds:.4g} s/step{gain}" if seconds else "-"
        console.print(f"{label}: {shown}", markup=False, highlight=False, soft_wrap=True)
    if settings.ignored:
        console.print(f"not priced (not parallelism or batch settings): {', '.join(settings.ignored)}",
                      markup=False, highlight=False, soft_wrap=True)


def _plan(args: argparse.Namespace, console: Console) -> int:
    top_k = [f"solver.top_k={args.top_k}"] if args.top_k is not None else []
    if args.multirun:
        return _sweep(args, top_k, console)
    # Without --out, plan.json goes to Hydra's run folder (outputs/<date>/<time>, or
    # hydra.run.dir) beside .hydra/, the record of the configuration that made it; both are
    # written once the plan exists, so a failed run leaves no folder behind.
    defaults = {"hydra.run.dir": args.out.parent} if args.out else {}
    overrides = _hydra_overrides(args, "plan", {**defaults, "hydra.output_subdir": "null"}, top_k)
    if _show_requested(args):
        return _show(args, overrides)
    from autopar.output_dir import check_out_dir
    from autopar.report.render import REPORT_FILES

    # Before planning: a place that cannot take the result is refused before the work is done.
    _check_out(args)
    if args.report is not None:
        check_out_dir(args.report, REPORT_FILES, force=False, flag="--report", whole_folder=False, can_force=False)
    if args.emit and args.out is not None:  # engine files beside --out replace none that autopar did not write
        from autopar.emit import writer

        check_out_dir(args.out.parent, [writer(engine).file_name for engine in args.emit], force=False, flag="--out",
                      whole_folder=False, can_force=False)

    def job(cfg: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        from autopar.specs import precision_note
        from autopar.report.rebuild import report_of
        from autopar.driver import run_plan
        from autopar.emit import engine_files
        from autopar.progress import PhaseProgress
        from autopar.report.terminal import print_plan

        _note(console, precision_note(cfg))
        with PhaseProgress(console, f"planning {args.model}") as progress:
            result = run_plan(args.model, cfg, progress=progress)
        print_plan(result, console)
        from autopar.hydra_app import write_provenance

        out = args.out or Path(HydraConfig.get().runtime.output_dir) / "plan.json"
        if args.out is None:
            write_provenance(cfg, out.parent)
        engine_texts = engine_files(result.plan, args.emit)  # an engine's refusal before anything is written
        write_atomically(out, result.plan.to_json())
        where = "" if args.out else " (Hydra's run folder: choose it with hydra.run.dir=DIR, or pass --out FILE)"
        console.print(f"wrote {_shown_path(out)}{where}")
        for name, text in engine_texts.items():
            write_atomically(out.parent / name, text)
            console.print(f"wrote {_shown_path(out.parent / name)}")
        if args.report is not None:
            with console.status("Writing the report ..."):
                files = write_report_atomically(report_of(result), args.report)
            console.print(f"wrote {files['report.html']} (and report.md, timeline.json)")

    _run_job(args, job, overrides)
    return 0


def _note(console: Console, text: str | None) -> None:
    """A setting that will not be honoured as given, said before the work starts."""
    if text:
        console.print(f"[bold yellow]note:[/] {text}", highlight=False)


def _shown_path(path: Path) -> Path:
    """A path as the user would type it: relative to the current folder when inside it."""
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def _sweep(args: argparse.Namespace, top_k: list[str], console: Console) -> int:
    from autopar import hydra_app
    from autopar.report.terminal import print_sweep
    from autopar.sweep import check_sweep, run_sweep, validation_overrides

    overrides = hydra_app.with_defaults("plan", list(args.overrides) + top_k, {})
    given = [item for item in overrides if item.startswith("hydra.sweep.dir=")]
    if args.out_dir is not None and given:
        raise ConfigError(f"Both --out-dir {args.out_dir} and {given[0]} name the sweep folder.",
                          "give one of them.")
    if _show_requested(args):
        raise ConfigError("--cfg and --info show one configuration, not a sweep's.",
                          "drop -m and give one value per key to see that point's configuration.")
    check_sweep(overrides)  # every swept value, before Hydra runs anything
    fixed = validation_overrides(overrides)[0]
    out_dir = args.out_dir or Path(hydra_app.resolved_hydra_setting(fixed, "hydra.sweep.dir"))
    rows = run_sweep(args.model, overrides, out_dir, quiet=args.quiet)
    print_sweep(rows, console)
    console.print(f"wrote {out_dir / 'sweep.csv'}, {out_dir / 'sweep.md'}, {out_dir / 'sweep.png'} and one folder "
                  "per point (plan.json, .hydra/)")
    bugs = [row for row in rows if row.get("traceback")]
    if bugs:  # a point hit a bug in autopar: the sweep went on, but say so as main() would
        print(f"internal error in sweep point {bugs[0]['point']} (a bug in autopar; please report it with this "
              f"output):\n{bugs[0]['traceback']}", file=sys.stderr)
        return 2
    return 0


def _report(args: argparse.Namespace, console: Console) -> int:
    from autopar.saved import read_plan
    from autopar.report.rebuild import read_report, rebuild_report, unreadable_report
    from autopar.output_dir import check_out_dir
    from autopar.report.render import REPORT_FILES

    source: Path = args.source
    if source.is_dir():
        saved, plan_file, out_dir = source / "report.json", source / "plan.json", args.out_dir or source
    else:
        saved, plan_file, out_dir = None, source, args.out_dir or source.parent
    check_out_dir(out_dir, REPORT_FILES, force=args.force, whole_folder=False)
    loaded = saved if saved is not None and saved.is_file() and args.model is None else None  # the report kept
    with console.status("Writing the report ...") as status:
        if loaded is not None:
            report = read_report(loaded, plan_file)
        else:
            plan = read_plan(plan_file)
            if args.model is None:
                named = plan.provenance.model_path or "its model file"
                raise UserError(f"Reporting {plan_file} means pricing it again, which imports its model file; autopar "
                                f"imports only a file named on the command line, never the one a plan names ({named}).",
                                "pass --model PATH/TO/model.py (its sha256 is checked against the plan before it is "
                                "imported).")
            status.update("Tracing the model and pricing the plan again ...")
            report = rebuild_report(plan, args.model)
        # The runs recorded beside the plan (autopar run, the module itself) add their loss curves.
        try:
            files = write_report_atomically(report, out_dir, force=args.force, flag="--out-dir", can_force=True,
                                            run_log=plan_file.parent / "run.jsonl")
        except (ArithmeticError, AttributeError, KeyError, IndexError, TypeError, ValueError) as err:
            if loaded is None or written_by_autopar(loaded):
                raise  # a report autopar priced or wrote itself that cannot be rendered: a bug
            raise unreadable_report(loaded, plan_file, err) from None
    curves = f", {files['loss.png']}" if "loss.png" in files else ""
    console.print(f"wrote {files['report.html']}, {files['report.md']}, {files['timeline.json']}{curves}")
    return 0


def written_by_autopar(path: Path) -> bool:
    """Whether ``path`` holds what autopar wrote there (its folder's manifest has its sha256)."""
    from autopar.output_dir import Manifest, sha256_of

    manifest = Manifest.read(path.parent)
    return manifest is not None and manifest.files.get(path.name) == sha256_of(path)


def _compile(args: argparse.Namespace, console: Console) -> int:
    top_k = [f"solver.top_k={args.top_k}"] if args.top_k is not None else []
    overrides = _hydra_overrides(args, "compile", NO_RUN_FOLDER, top_k)
    if _show_requested(args):
        return _show(args, overrides)

    def job(cfg: Any) -> None:
        from autopar import hydra_app
        from autopar.specs import precision_note
        from autopar.driver import run_compile
        from autopar.progress import PhaseProgress
        from autopar.report.terminal import print_plan

        _note(console, precision_note(cfg))
        with PhaseProgress(console,
                           f"planning {args.model}" if args.plan is None else f"reusing {args.plan}") as progress:
            plan, result, files = run_compile(args.model, cfg, args.out_dir, args.plan, progress=progress,
                                              provenance=hydra_app.provenance_files(cfg), force=args.force,
                                              emit=tuple(args.emit))
        if result is not None:
            print_plan(result, console)
            for rejected in result.rejected:
                console.print(f"[yellow]rejected at compile[/]: {escape(rejected.summary)}: {escape(rejected.reason)}",
                              highlight=False)
        else:
            console.print(f"reused {args.plan}: dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} "
                          f"ZeRO-{plan.zero_stage}, predicted {plan.predicted.step_time_s:.3g} s/step")
        report_file = Path(args.out_dir) / "report.json"
        if report_file.is_file():
            from autopar.report.document import load_report

            console.print(f"proven at compile: {load_report(report_file).proof}", markup=False, highlight=False)
        console.print(f"wrote {', '.join(str(path) for path in files.values())}")
        # One line, taken literally: the command can be copied into a shell whatever the folder's name.
        console.print(f"run it here with `autopar run {shlex.quote(str(args.out_dir))}`, on the cluster with "
                      f"{shlex.quote(str(files['launch']))}", soft_wrap=True, markup=False, highlight=False)

    _run_job(args, job, overrides)
    return 0


SHOWN_STEPS = 15  # rows of `autopar run`'s table


def _run(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from autopar.runtime import run_local
    from autopar.runtime.run_settings import launch_plan

    for option, value, lowest in (("--steps", args.steps, 1), ("--checkpoint-every", args.checkpoint_every, 1),
                                  ("--max-restarts", args.max_restarts, 0)):
        if value is not None and value < lowest:
            raise UserError(f"{option} {value} is out of range: it must be an integer >= {lowest}.",
                            f"pass {option} {lowest} or more.")
    if args.init_from is not None:
        check_weights(args.init_from)  # before any rank starts
    extra = ["--checkpoint-every", str(args.checkpoint_every)] if args.checkpoint_every is not None else []
    extra += ["--allow-fresh-start"] if args.allow_fresh_start else []
    extra += metrics_arguments(args)
    plan = launch_plan(args.out_dir)  # its numbers in range and the module's, before anything starts
    if args.nproc is not None and args.nproc != plan.world_size:
        raise UserError(f"{args.out_dir} was compiled for {plan.world_size} ranks, not {args.nproc}.",
                        f"run it with --nproc {plan.world_size} (or omit --nproc), or compile again for "
                        f"{args.nproc} GPUs.")
    from autopar.runtime.generated import find_script
    from autopar.runtime.run_settings import check_run_data, module_arguments, module_options

    script = find_script(args.out_dir)
    settings, data = module_arguments(args.overrides, module_options(script))
    with console.status("Reading the training data ..."):
        corpus = check_run_data(args.out_dir, script, data, plan.global_batch_size)
    if corpus:
        console.print(f"training data: {corpus}", markup=False)
    extra += settings
    title = f"{plan.world_size} local ranks"
    progress = None if args.echo else run_progress(args, console, title, plan.world_size)
    with progress or console.status(f"Running {title} ..."):
        result = run_local(args.out_dir, plan.world_size, args.steps, extra_args=extra, echo=args.echo,
                           max_restarts=args.max_restarts, init_from=args.init_from, export=args.export,
                           on_line=progress.feed_line if progress else None)
    for warning in result.warnings:  # shown with or without --echo; one line, as the rank wrote it
        console.print(warning, markup=False, soft_wrap=True)
    if result.teardown_failure is not None:
        console.print(f"note: every rank finished and wrote its results, then one died while shutting down "
                      f"(torchrun exit {result.teardown_failure}); the run counts as finished", markup=False)
    if not result.ok:
        where = f"rank {result.failed_rank}" if result.failed_rank is not None else "a rank"
        raise UserError(f"The run failed on {where} (exit {result.returncode}):\n{result.error}",
                        "fix the error above (rerun with --echo for every rank's output).")
    table = Table("step", "loss", "step time", "tokens/s", "peak memory")
    steps = [r for r in result.records if "loss" in r]
    if len(steps) > SHOWN_STEPS:  # a long run: its first steps and its last (run.jsonl has all)
        steps = steps[:3] + steps[-(SHOWN_STEPS - 3):]
    for record in steps:
        table.add_row(str(record["step"]), f"{record['loss']:.5f}", f"{record['step_time_s'] * 1e3:.1f} ms",
                      f"{record['tokens_per_s']:,.0f}", f"{record['peak_memory_bytes'] / 2**20:,.1f} MiB")
    console.print(table)
    for record in (r for r in result.records if "val_loss" in r):
        console.print(f"validation loss after step {record['step']}: {record['val_loss']:.5f}", markup=False)
    console.print(f"appended {len(result.records)} records to {args.out_dir / 'run.jsonl'}")
    return 0


def check_weights(path: Path) -> None:
    """Refuse --init-from PATH when it holds no weights the module can read."""
    from autopar.sections.pretrained import WeightsError, weight_files

    try:
        weight_files(path)
    except WeightsError as error:
        raise UserError(str(error)) from None


def metrics_arguments(args: argparse.Namespace) -> list[str]:
    """The module's metrics options `autopar run` passes on; refuses a dashboard whose package is
    missing before any rank starts."""
    from autopar.sections.metrics import MetricsConfig, missing_packages

    missing = missing_packages(MetricsConfig(wandb_project=args.wandb, mlflow_experiment=args.mlflow))
    if missing:
        raise UserError(missing[0].removesuffix("."), "install it, or leave the option out.")
    forwarded = ["--no-tensorboard"] if args.no_tensorboard else []
    forwarded += ["--wandb", args.wandb] if args.wandb is not None else []
    return forwarded + (["--mlflow", args.mlflow] if args.mlflow is not None else [])


def run_progress(args: argparse.Namespace, console: Console, title: str, world: int) -> Any:
    """`autopar run`'s progress display (a bar on a terminal, timestamped lines otherwise)."""
    from autopar.runtime.generated import find_script
    from autopar.runtime.local import LOG_NAME
    from autopar.runtime.progress import RunProgress, default_steps

    steps = args.steps if args.steps is not None else default_steps(find_script(args.out_dir))
    return RunProgress.for_console(console, steps, args.out_dir / LOG_NAME, title, max_restarts=args.max_restarts,
                                   world=world)


def _validate(args: argparse.Namespace, console: Console) -> int:
    from autopar.report.terminal import print_validation
    from autopar.runtime.validate import validate

    with console.status(f"Running and measuring {args.out_dir} ..."):
        result = validate(args.out_dir, steps=args.steps)
    print_validation(result, console)
    console.print(f"wrote {args.out_dir / 'validate.json'}")
    return 0


def _calibrate(args: argparse.Namespace, console: Console) -> int:
    from autopar.output_dir import check_out_file

    check_out_file(args.out)  # before measuring for seconds
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
    try:
        scale = fit_time_scale(runs)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:  # a file that was not validate's
        text = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise UserError(f"The files given to --from do not hold what `autopar validate` writes ({text}).",
                        "pass validate.json files as `autopar validate DIR` wrote them.") from None
    write_profile(scale, args.out, args.base, [str(path) for path in args.validations])
    console.print("fitted factors (measured / predicted): " + ", ".join(f"{k} {v:.3g}" for k, v in scale.items()))
    console.print(f"wrote {args.out}; price with it: cluster.hardware_profile={args.out}")
    return 0


def write_report_atomically(report, out_dir: Path, force: bool = False, flag: str = "--report",
                            can_force: bool = False, run_log: Path | None = None) -> dict[str, Path]:
    """Render into a staging folder, then move the files in, so a failure leaves nothing
    half-written; report files autopar did not write there are not replaced without ``force``."""
    from autopar.output_dir import install, staging_dir
    from autopar.report.render import write_report

    with staging_dir(out_dir) as staging:
        files = write_report(report, staging, run_log)
        install(staging, out_dir, force=force, flag=flag, whole_folder=False, can_force=can_force)
    return {name: out_dir / path.name for name, path in files.items()}


# Allocations between young-generation collections in the `autopar` process (CPython's default is
# 700): tracing and planning keep millions of objects alive (torch, the traced graphs, the search's
# candidates), and at the default the collector ran eight full collections over all of them (0.85 s
# of the 70B `autopar plan`'s 9.9 s; none at this threshold, 0.4 s of young collections left).
YOUNG_COLLECTION_ALLOCATIONS = 10_000


def command() -> int:
    """The `autopar` command (and `python -m autopar.cli`): `main`, then the process ends. The
    collector runs less often while it works (YOUNG_COLLECTION_ALLOCATIONS), and what a plan leaves
    in memory (traced graphs, hundreds of thousands of candidates) is frozen out of it at the end,
    so the interpreter's last collection on the way out does not walk it all (1.2 s of the 70B
    `autopar plan`); it is freed as the process ends either way. Neither in `main`, which tests and
    library callers run inside a process that goes on."""
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(command())
