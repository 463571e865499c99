"""Words the generated module prints for the launcher that reads its output: kept in a section of
their own, free of imports, so the launching CLI reads them without importing the training code."""
from __future__ import annotations

# A rank prints it, with its rank, world size and attempt, once everything it owes is written
# (trained, saved, exported): a failure after it is the process group's teardown, not the run's.
FINISHED_MARKER = "rank-finished:"
