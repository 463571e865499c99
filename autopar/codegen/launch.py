"""Launch scripts for a generated module: torchrun (any cluster) and SLURM sbatch."""
from __future__ import annotations

import re
import shlex

from autopar.launch_env import STORE_PER_ATTEMPT_ENV

STORE_PER_ATTEMPT = "# A fresh rendezvous store per restart (a shared one hands restarted ranks stale addresses).\n" + \
    "\n".join(f"export {name}=${{{name}:-{value}}}" for name, value in STORE_PER_ATTEMPT_ENV.items())


def shell_word(name: str) -> str:
    """A file name as one shell word that runs nothing (spaces, quotes, `$(...)` stay literal)."""
    return shlex.quote(name)


def comment_text(name: str) -> str:
    """A file name fit for a `#` comment line: a newline in it would start a command line."""
    return "".join(ch if ch.isprintable() else "?" for ch in name)


def plain_token(name: str) -> str:
    """A file name reduced to letters, digits, `_`, `.` and `-`: for values that are not paths
    (a rendezvous id, a job name) and must survive any quoting."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "autopar"


def launch_script(script: str, world_size: int, gpus_per_node: int) -> str:
    """``launch.sh``: torchrun on this node; run it on every node of a multi-node job.

    Args:
        script: the generated module's file name.
        world_size: ranks the plan needs.
        gpus_per_node: ranks per node.
    """
    nodes = max(1, -(-world_size // gpus_per_node))
    per_node = min(world_size, gpus_per_node)
    return f"""#!/usr/bin/env bash
# Launch {comment_text(script)} on {nodes} node(s) x {per_node} rank(s) = {world_size} ranks, as planned.
# Run this same command on every node; the nodes meet at RDZV_HOST:RDZV_PORT (the first node).
#   single node:  ./launch.sh --steps 10
#   multi-node:   RDZV_HOST=node0 ./launch.sh --steps 10     (on each node)
# Extra arguments go to the training script (--steps, --lr, --seed, --log-file, --checkpoint-every).
# A failed rank makes torchrun restart all ranks, up to MAX_RESTARTS times; with checkpoints
# (--checkpoint-every N) they resume from the latest complete one.
set -euo pipefail
cd "$(dirname "$0")"
NNODES=${{NNODES:-{nodes}}}
NPROC_PER_NODE=${{NPROC_PER_NODE:-{per_node}}}
MAX_RESTARTS=${{MAX_RESTARTS:-3}}
{STORE_PER_ATTEMPT}
LOCAL=()
if [ "$NNODES" = 1 ] && [ -z "${{RDZV_HOST:-}}" ]; then
    # One node: meet on the loopback interface only, at a free port unless one is given.
    RDZV_HOST=127.0.0.1
    RDZV_PORT=${{RDZV_PORT:-0}}
    LOCAL=(--local-addr=127.0.0.1)
    export GLOO_SOCKET_IFNAME=${{GLOO_SOCKET_IFNAME:-lo}}
fi
RDZV_HOST=${{RDZV_HOST:-localhost}}
RDZV_PORT=${{RDZV_PORT:-29500}}
RDZV_ID=${{RDZV_ID:-{plain_token(script.removesuffix('.py'))}}}
if [ "$NNODES" = 1 ] && [ "$RDZV_PORT" != 0 ] && (exec 3<>"/dev/tcp/$RDZV_HOST/$RDZV_PORT") 2>/dev/null; then
    # torchrun would wait on the other program's port instead of failing
    echo "launch.sh: port $RDZV_PORT on $RDZV_HOST is taken by another program; set RDZV_PORT to a free one." >&2
    exit 1
fi
exec torchrun \\
    "${{LOCAL[@]}}" \\
    --nnodes="$NNODES" \\
    --nproc-per-node="$NPROC_PER_NODE" \\
    --rdzv-backend=c10d \\
    --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" \\
    --rdzv-id="$RDZV_ID" \\
    --max-restarts="$MAX_RESTARTS" \\
    {shell_word(script)} "$@"
"""


def sbatch_script(script: str, world_size: int, gpus_per_node: int, job_name: str) -> str:
    """``sbatch.sh``: one torchrun per node under SLURM, meeting at the job's first node."""
    nodes = max(1, -(-world_size // gpus_per_node))
    per_node = min(world_size, gpus_per_node)
    return f"""#!/usr/bin/env bash
# Submit with: sbatch sbatch.sh --steps 100    (arguments go to {comment_text(script)})
#SBATCH --job-name={plain_token(job_name)}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --cpus-per-task=16
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${{SLURM_SUBMIT_DIR:-$(dirname "$0")}}"
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${{RDZV_PORT:-29500}}
MAX_RESTARTS=${{MAX_RESTARTS:-3}}  # restarts of failed ranks; use --checkpoint-every N to resume
{STORE_PER_ATTEMPT}
srun torchrun \\
    --nnodes="$SLURM_NNODES" \\
    --nproc-per-node={per_node} \\
    --rdzv-backend=c10d \\
    --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" \\
    --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts="$MAX_RESTARTS" \\
    {shell_word(script)} "$@"
"""
