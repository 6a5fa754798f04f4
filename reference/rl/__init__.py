"""The reference async RL run: what `rollsafe demo` runs (docs/demo.md)."""
