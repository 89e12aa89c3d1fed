"""What the PolaDiT fixture tests share: running our model on the official timestep embedding that
scripts/dit_reference.py recorded with its outputs.

The DiT's timestep embedding is float32 by design (the checkpoints were trained so), and float32 exp, sin and
cos differ in their last bits between CPU vector instruction sets (AVX2, AVX-512): one ulp of a frequency
moves cos/sin(t·f) by up to ~6e-5 at t = 999, which a random tiny network carries to ~1e-4 in its output.
So the float64 fixtures are compared with the official embedding rows put in place of ours, which makes them
hold on every CPU; the embedding itself is compared to the official table within float32's rounding
(tests/models/test_pola_dit.py)."""
import torch

import polaformer.models.pola_dit as pola_dit


def use_recorded_embedding(monkeypatch, steps: torch.Tensor, table: torch.Tensor) -> None:
    """Make PolaDiT embed each timestep in ``steps`` as the official row of ``table`` (and refuse others)."""
    rows = {int(t): row for t, row in zip(steps, table)}

    def recorded(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = sorted({int(s) for s in t} - rows.keys())
        assert not missing and table.shape[1] == dim, f"no official embedding recorded for timesteps {missing}"
        return torch.stack([rows[int(s)] for s in t]).to(t.device)

    monkeypatch.setattr(pola_dit, "timestep_frequencies", recorded)
