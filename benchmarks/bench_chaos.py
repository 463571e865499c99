"""Fault injection: `autopar run` of a tiny 2-rank gloo plan, interrupted at random, must end
with every step trained and exactly the parameters of an uninterrupted run.

    python -m benchmarks.run chaos                       # CHAOS_RUNS=50 CHAOS_SEED=0 by default
    CHAOS_RUNS=10 CHAOS_SEED=3 python -m benchmarks.run chaos
    CHAOS_KINDS=symlinks,renamed,pickle CHAOS_RUNS=6 python -m benchmarks.run chaos   # some kinds only

Each run copies a compiled folder, starts `autopar run DIR --steps 6 --checkpoint-every 2` and
injects one fault, drawn with the seed:
    kill_rank / int_rank   SIGKILL / SIGINT one rank after a random delay (torchrun restarts once)
    kill_cli / int_cli     SIGKILL / SIGINT the `autopar run` process itself
    truncate               finish 4 steps, then cut the newest checkpoint's shard short
    disk_full              checkpoints on a 2 MiB tmpfs (one checkpoint fits): the save fails
                           with ENOSPC named; then the tmpfs is grown ("space freed")
    concurrent             a second `autopar run` of the folder while the first runs: refused
    symlinks               run.jsonl, the run lock and checkpoints/ made links to files and a
                           folder outside: the run is refused naming a link and what they point
                           at is untouched; then the links are removed, as the message says
    renamed                finish 4 steps, then rename step_4 to step_40: resumed at step 4
    pickle                 finish 4 steps, then replace step_4's .metadata by a pickle that
                           would create a file, checksums rewritten to match: no code runs, the
                           run resumes from step_2
    term_cli               SIGTERM the `autopar run` process: handled like Ctrl-C (exit 143); the
                           note says its exit and how long its ranks outlived it (also for
                           kill_cli/int_cli: torchrun and the ranks die with the CLI)
then runs `autopar run` again (waiting while a killed run's ranks still hold the folder) until
the run completes. Reported: runs survived (finished, every step's record present, the final
checkpoint at step 6), steps lost (steps of the final checkpoint short of 6, summed), runs in
which code from a checkpoint ran, and the largest parameter difference from the uninterrupted
run's final checkpoint (all must be 0).
disk_full needs root (mount); without it those draws become truncate.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, EVERY = 6, 2
KINDS = ("kill_rank", "int_rank", "kill_cli", "int_cli", "truncate", "disk_full", "concurrent", "symlinks",
         "renamed", "pickle")
KINDS += ("term_cli",)  # SIGTERM of the CLI
CLI_SIGNALS = {"kill_cli": signal.SIGKILL, "int_cli": signal.SIGINT, "term_cli": signal.SIGTERM}
LOCKED = "is being run by another"
LINKED = ("run.jsonl", ".autopar-run.lock", "checkpoints")


class Marker:
    """Unpickled, it creates the file ``path``: a crafted checkpoint's payload (it must never run)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('ran')",)


def _cli(folder: Path, *extra: str, steps: int = STEPS) -> list[str]:
    """`autopar run` of ``folder``; the schedule is pinned to STEPS, so a run stopped after fewer
    steps and continued trains exactly as an uninterrupted one."""
    return [sys.executable, "-m", "autopar.cli", "run", str(folder), "--steps", str(steps),
            "--checkpoint-every", str(EVERY), f"optim.decay_steps={STEPS}", *extra]


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _ranks(folder: Path) -> list[int]:
    """Pids of the training processes of ``folder`` (their command line names its module)."""
    script = str(sorted(folder.glob("parallel_*.py"))[0])
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            launcher = b"autopar.runtime.loopback" in words or b"torch.distributed.run" in words
            if any(w.decode(errors="replace").endswith(script) for w in words) and not launcher:
                pids.append(int(entry.name))
    return pids


def _run_until_done(folder: Path, deadline_s: float = 300) -> tuple[bool, str]:
    """`autopar run` again until it finishes (a killed run's ranks may hold the folder a while)."""
    end = time.monotonic() + deadline_s
    output = ""
    while time.monotonic() < end:
        done = subprocess.run(_cli(folder, "--max-restarts", "1"), capture_output=True, text=True)
        output = done.stdout + done.stderr
        if done.returncode == 0:
            return True, output
        if LOCKED not in output:
            return False, output
        time.sleep(2)
    return False, output


def _outlived(cli: subprocess.Popen, folder: Path, limit_s: float = 60) -> str:
    """The signalled CLI's exit and how long the ranks outlived it."""
    cli.wait(timeout=600)
    ended = time.monotonic()
    while _ranks(folder) and time.monotonic() - ended < limit_s:
        time.sleep(0.2)
    return f"cli exit {cli.returncode}, ranks gone {time.monotonic() - ended:.1f} s after it"


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _final_weights(folder: Path):
    from autopar.sections.checkpoint import consolidated_weights, latest_checkpoint
    latest = latest_checkpoint(folder / "checkpoints")
    return (latest[0], consolidated_weights(latest[1])) if latest else (0, {})


def _first_four_steps(folder: Path) -> Path:
    """Train 4 of the 6 steps (checkpoints step_2, step_4); step_4's folder."""
    subprocess.run(_cli(folder, steps=4), capture_output=True)
    return folder / "checkpoints" / "step_4"


def _plant_links(folder: Path, root: Path) -> tuple[str, bool]:
    """Point the run's files at files of "the user's" outside the folder, run once: (note, safe),
    safe when the run was refused naming a link and nothing outside changed. The links are then
    removed, as the refusal says."""
    outside = root / "outside"
    shutil.rmtree(outside, ignore_errors=True)
    (outside / "folder").mkdir(parents=True)
    (outside / "folder" / "COMPLETE").write_text("the user's\n")
    for name in LINKED:
        target = outside / ("folder" if name == "checkpoints" else name)
        if name != "checkpoints":
            target.write_text("the user's\n")
        (folder / name).symlink_to(target)
    before = {str(p): p.read_text() for p in outside.rglob("*") if p.is_file()}
    refused = subprocess.run(_cli(folder), capture_output=True, text=True)
    after = {str(p): p.read_text() for p in outside.rglob("*") if p.is_file()}
    for name in LINKED:
        (folder / name).unlink()
    safe = refused.returncode == 1 and "is a symbolic link" in refused.stderr and after == before
    return ("refused, link targets untouched" if safe else f"rc {refused.returncode}, targets "
            f"{'untouched' if after == before else 'CHANGED'}: {refused.stderr[-200:]!r}"), safe


def _craft_pickle(step: Path, marker: Path) -> None:
    """Replace DCP's metadata by a pickle that runs code, with COMPLETE rewritten to match."""
    from autopar.sections.checkpoint import COMPLETE, file_digests
    (step / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    (step / COMPLETE).write_text(json.dumps({"step": 4, "sha256": file_digests(step)}))


def _trial(template: Path, root: Path, kind: str, rng: random.Random) -> dict:
    folder = root / "run"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(template, folder)
    mounted, safe = False, True
    note = ""
    marker = root / "CODE-RAN"
    marker.unlink(missing_ok=True)
    if kind in ("kill_rank", "int_rank", *CLI_SIGNALS, "concurrent"):
        first = _start(_cli(folder, *(["--max-restarts", "1"] if kind.endswith("rank") else [])))
        time.sleep(rng.uniform(2, 8) if kind == "concurrent" else rng.uniform(4, 14))
        if kind.endswith("rank"):
            ranks = _ranks(folder)
            if ranks:
                os.kill(rng.choice(ranks), signal.SIGKILL if kind == "kill_rank" else signal.SIGINT)
        elif kind in CLI_SIGNALS:
            first.send_signal(CLI_SIGNALS[kind])
            note = _outlived(first, folder)
        else:
            second = subprocess.run(_cli(folder), capture_output=True, text=True, timeout=120)
            refused = second.returncode == 1 and LOCKED in second.stderr + second.stdout
            note = "second run refused" if refused else f"second run rc {second.returncode}"
        first.communicate(timeout=600)
    elif kind == "truncate":
        subprocess.run(_cli(folder, steps=4), capture_output=True)
        shard = sorted((folder / "checkpoints" / "step_4").glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[:rng.randrange(1, shard.stat().st_size)])
    elif kind == "disk_full":
        mounted = _mount_tmpfs(folder / "checkpoints", "2m")
        failed = subprocess.run(_cli(folder), capture_output=True, text=True)
        note = "ENOSPC named" if "ENOSPC" in failed.stderr else f"rc {failed.returncode}: {failed.stderr[-200:]!r}"
        subprocess.run(["mount", "-o", "remount,size=64m", str(folder / "checkpoints")], check=True)
    elif kind == "symlinks":
        note, safe = _plant_links(folder, root)
    elif kind == "renamed":
        step = _first_four_steps(folder)
        step.rename(step.with_name("step_40"))
    elif kind == "pickle":
        _craft_pickle(_first_four_steps(folder), marker)
    survived, output = _run_until_done(folder)
    log = folder / "run.jsonl"
    records = log.read_text().splitlines() if log.exists() else []
    steps_seen = {json.loads(line)["step"] for line in records}
    if kind in ("renamed", "pickle") and records:
        last = json.loads(records[-1])["run_id"]
        resumed_at = min(json.loads(line)["step"] for line in records if json.loads(line)["run_id"] == last)
        note = f"resumed at step {resumed_at}"
    step, weights = _final_weights(folder)
    result = {"kind": kind, "survived": survived and steps_seen >= set(range(STEPS)) and step == STEPS and safe
              and not marker.exists(), "steps_lost": STEPS - step, "code_ran": marker.exists(), "weights": weights,
              "note": note,
              "attempts": len({(json.loads(line)["run_id"], json.loads(line)["attempt"]) for line in records})}
    if not survived:
        result["note"] += " | " + output[-300:]
    if mounted:
        subprocess.run(["umount", str(folder / "checkpoints")], check=False)
    return result


def run() -> list[dict]:
    from autopar.codegen import generate
    from tests.dist.plans import GPT, make_plan

    runs = int(os.environ.get("CHAOS_RUNS", "50"))
    kinds = [k for k in os.environ.get("CHAOS_KINDS", ",".join(KINDS)).split(",") if k in KINDS] or list(KINDS)
    rng = random.Random(int(os.environ.get("CHAOS_SEED", "0")))
    root = Path(tempfile.mkdtemp(prefix="autopar-chaos-"))
    try:
        template = root / "template"
        generate(make_plan(GPT, dp=2), GPT.path, template)
        reference = root / "reference"
        shutil.copytree(template, reference)
        ok, output = _run_until_done(reference)
        assert ok, output
        _, expected = _final_weights(reference)
        can_mount = _mount_tmpfs(root / "probe", "1m")
        if can_mount:
            subprocess.run(["umount", str(root / "probe")], check=False)
        rows, drift, started = [], 0.0, time.monotonic()
        for index in range(runs):
            kind = rng.choice(kinds)
            kind = "truncate" if kind == "disk_full" and not can_mount else kind
            trial = _trial(template, root, kind, rng)
            weights = trial.pop("weights")
            trial_drift = max(((weights[k] - expected[k]).abs().max().item() for k in expected), default=float("inf")) \
                if weights.keys() == expected.keys() else float("inf")
            drift = max(drift, trial_drift)
            print(f"run {index}: {trial} drift {trial_drift}", flush=True)
            rows.append({**trial, "drift": trial_drift})
        summary = {"runs": runs, "survived": sum(r["survived"] for r in rows),
                   "steps_lost": sum(r["steps_lost"] for r in rows), "code_ran": sum(r["code_ran"] for r in rows),
                   "max_parameter_drift": drift,
                   "minutes": round((time.monotonic() - started) / 60, 1)}
        by_kind = [{"kind": k, "runs": sum(r["kind"] == k for r in rows),
                    "survived": sum(r["survived"] for r in rows if r["kind"] == k),
                    "notes": "; ".join(sorted({r["note"] for r in rows if r["kind"] == k and r["note"]}))[:200]}
                   for k in kinds]
        return [summary, *by_kind]
    finally:
        for mount in (root / "run" / "checkpoints",):
            subprocess.run(["umount", str(mount)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
