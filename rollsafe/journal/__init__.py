"""The journal of a run's state changes between snapshots (issue 20; docs/journal.md to come)."""
