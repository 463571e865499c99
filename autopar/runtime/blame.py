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
several splits blames none (the check cannot tell which), and only that plan is excluded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.profile import ModelProfile


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
    from one process), or None when it splits the model more than one way."""
    others = plan.tp > 1 or plan.pp > 1 or plan.ep > 1
    batch_parts = [f"dp={plan.dp}"] * (plan.dp > 1) + [f"{plan.num_micro_batches} micro-batches"] * (
        plan.num_micro_batches > 1)
    if plan.cp > 1 and not others and not batch_parts:
        return Blame("splitting the sequence (context parallelism)",
                     f"compile's check measured the model with its sequence split over cp={plan.cp} ranks training "
                     f"something else ({difference}): an op reads positions other than through the attention that "
                     "context parallelism replaces (a recurrence, a convolution or a window along the sequence, a "
                     "mask built from the positions)", splits_sequence=True)
    if batch_parts and not others and plan.cp == 1:
        return Blame("splitting the batch (data parallelism, ZeRO, micro-batches)",
                     f"compile's check measured the model with its batch split ({', '.join(batch_parts)}) training "
                     f"something else ({difference}): the samples of a batch meet in the model or its loss (a loss "
                     "comparing the samples with each other, as a contrastive loss does; statistics over the batch; "
                     "a mean over a count that differs between the parts other than cross-entropy's)",
                     splits_sequence=False)
    return None
