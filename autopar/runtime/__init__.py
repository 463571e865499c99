"""Running generated modules: local multi-process runs and the single-process reference.

    result = run_local("out/", nproc=4, steps=5)   # torchrun on this machine; result.records
"""
from autopar.runtime.local import RunResult, read_records, run_local
from autopar.runtime.reference import ReferenceRun, run_reference

__all__ = ["ReferenceRun", "RunResult", "read_records", "run_local", "run_reference"]
