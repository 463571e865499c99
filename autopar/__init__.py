"""autopar: trace a PyTorch model, price every way of splitting it, and emit the fastest plan.

In a training script of your own: ``autopar.plan``, ``autopar.parallelize``, ``autopar.estimate``
(autopar/api.py); imported when first used, so the command line starts without torch. The plan
they return is `autopar.plans.Plan`.
"""

__version__ = "0.1.0"

API = ("plan", "parallelize", "estimate", "ParallelTraining")


def __getattr__(name: str):
    if name in API:
        from autopar import api

        return getattr(api, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
