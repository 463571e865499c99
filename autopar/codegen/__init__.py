"""Plan -> a readable, self-contained parallel training module and its launch scripts.

    files = generate(plan, "examples/gpt.py", "out/")   # out/parallel_gpt.py, launch.sh, sbatch.sh
"""
from autopar.codegen.errors import CodegenError
from autopar.codegen.generate import GeneratedFiles, generate

__all__ = ["CodegenError", "GeneratedFiles", "generate"]
