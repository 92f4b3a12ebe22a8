"""Data: batches as a pure function of (seed, step, data-parallel rank, data-parallel size)."""
