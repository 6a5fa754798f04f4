"""Temporal workflow definitions: deterministic orchestration only (no I/O, no numpy/ray)."""
