"""Tolerances of half-precision results against float64, from the unit roundoff of the dtype (tests' helper)."""
import torch

# The largest relative error of one rounding to nearest in each dtype (half its spacing at 1).
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}

# Roundings to the inputs' dtype that an output or gradient of the fused kernels passes through, at most: the
# operands of the products (features, the state or the output's gradient over the normaliser, the state's
# gradient) and the stored result. Each product term is then off by at most this many unit roundoffs, relatively.
ROUNDINGS = 4


def half_tolerance(dtype: torch.dtype) -> float:
    """RMS(error) / RMS(float64 result) allowed for a kernel result on ``dtype`` inputs: :data:`ROUNDINGS` unit
    roundoffs (the per-term bound; over a tensor the sums cancel as much as the reference's)."""
    return ROUNDINGS * UNIT_ROUNDOFF[dtype]
