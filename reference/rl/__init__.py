"""The reference async RL run (issue 7)."""
