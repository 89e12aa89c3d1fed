"""Speed and memory benchmarks behind ``polaformer bench`` (see docs/benchmarks.md)."""
from .suite import (
    OP_METHODS,
    BenchConfig,
    count_flops,
    fit_exponent,
    matmul_gflops,
    roofline_fraction,
    run_bench,
)

__all__ = [
    "OP_METHODS",
    "BenchConfig",
    "count_flops",
    "fit_exponent",
    "matmul_gflops",
    "roofline_fraction",
    "run_bench",
]
