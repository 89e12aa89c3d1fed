"""Analysis tools: attention maps, positive-sequence entropy, gate correlation (``polaformer analyze``)."""
from .attention_maps import (
    AnalyzeError,
    analyze,
    positive_sequence_entropy,
    power_entropy,
    row_entropies,
    sample_rows,
)

__all__ = ["AnalyzeError", "analyze", "positive_sequence_entropy", "power_entropy", "row_entropies", "sample_rows"]
