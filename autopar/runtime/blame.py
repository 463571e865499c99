"""Which technique a plan that trained something else is to blame for, so compile's next plan
goes without it.

Compile's numerical check (proof.py) can find a plan whose run finished but whose loss or
parameters differ from one process. Excluding only that plan would hand the next-best plan,
which usually splits the model the same way with another ZeRO stage or micro-batch size, to the
same failure. Where the failing plan used one way of splitting the work alone, that way is to
blame, and the profile is marked as the analysis would have marked it had it found the cause:
splitting the batch (data parallelism, ZeRO, micro-batches) as a batch norm marks it, splitting
the sequence (context parallelism) as a recurrence marks it. The search then finds the best plan
without it, and a pin that needs it is refused naming the measured cause. A plan combining
several splits cannot tell which is to blame: compile checks each of its batch and sequence
splits alone on 2 ranks (`diagnostic_pins`) and blames the one that trains something else; where
neither does, only that plan is excluded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile


@dataclass(frozen=True)
class Blame:
    """A way of splitting the work that made a plan train another model.

    Attributes:
        technique: what is excluded from now on, in words ("splitting the batch").
        cause: why, in words a user can act on (the measured difference included).
        splits_sequence: the sequence split (context parallelism) is blamed, else the batch split.
    """

    technique: str
    cause: str
    splits_sequence: bool

    def excluded_from(self, profile: "ModelProfile") -> "ModelProfile":
        """``profile`` marked so the search never splits the way this blames."""
        if self.splits_sequence:
            return dataclasses.replace(profile, sequence_mixers=[self.cause, *profile.sequence_mixers])
        return dataclasses.replace(profile, batch_mixer=self.cause)


def blame(plan: Any, difference: str) -> Blame | None:
    """The split to blame for ``plan`` training something else (``difference``: how it differs
    from one process), or None when it splits the model more than one way (`diagnostic_pins`
    then says which single splits to check alone)."""
    others = plan.tp > 1 or plan.pp > 1 or plan.ep > 1
    batch_parts = _batch_parts(plan)
    if plan.cp > 1 and not others and not batch_parts:
        return sequence_blame(f"with its sequence split over cp={plan.cp} ranks", difference)
    if batch_parts and not others and plan.cp == 1:
        return batch_blame(f"with its batch split ({', '.join(batch_parts)})", difference)
    return None


def sequence_blame(how: str, difference: str) -> Blame:
    """Context parallelism to blame: the check measured the model ``how`` training something else."""
    return Blame("splitting the sequence (context parallelism)",
                 f"compile's check measured the model {how} training something else ({difference}): an op reads "
                 "positions other than through the attention that context parallelism replaces (a recurrence, a "
                 "convolution or a window along the sequence, a mask built from the positions)", splits_sequence=True)


def batch_blame(how: str, difference: str) -> Blame:
    """The batch split to blame: the check measured the model ``how`` training something else."""
    return Blame("splitting the batch (data parallelism, ZeRO, micro-batches)",
                 f"compile's check measured the model {how} training something else ({difference}): the samples of "
                 "a batch meet in the model or its loss (a loss comparing the samples with each other, as a "
                 "contrastive loss does; statistics over the batch; a mean over a count that differs between the "
                 "parts other than cross-entropy's)", splits_sequence=False)


def diagnostic_pins(plan: Any) -> list[tuple[bool, dict[str, int]]]:
    """For a plan splitting several ways that trained something else: the single splits to check
    alone on 2 ranks, each as (splits the sequence, its plan.* pins) — the batch split as dp=2
    (micro-batches split it the same way), the sequence as cp=2. Empty where `blame` decides
    alone or neither split is used (a tensor-parallel or pipeline split alone is autopar's to fix)."""
    if blame(plan, "") is not None:
        return []
    single = dict(dp=1, tp=1, pp=1, cp=1, ep=1)
    pins = []
    if _batch_parts(plan):
        pins.append((False, {**single, "dp": 2}))
    if plan.cp > 1:
        pins.append((True, {**single, "cp": 2}))
    return pins


def _batch_parts(plan: Any) -> list[str]:
    return [f"dp={plan.dp}"] * (plan.dp > 1) + [f"{plan.num_micro_batches} micro-batches"] * (
        plan.num_micro_batches > 1)
