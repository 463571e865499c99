"""Runtime code that `autopar.codegen` copies into every generated ``parallel_<model>.py``, and that
analysis calls where it must judge what the generated code will do (the model.py contract, the
attention's causal-mask test, the fused-projection cuts): written once, used by both.

Each module here is one section of the generated file and does one job. They are ordinary
modules (importable and testable on their own); when a file is generated, their imports from
``autopar.sections`` are dropped, because in the generated file every section lives in
the same namespace. Nothing in this package may import anything but the standard library and
torch: the generated file must run where only torch and the user's model.py are installed.
"""
