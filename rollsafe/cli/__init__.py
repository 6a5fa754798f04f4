"""The ``rollsafe`` command: one module per command group (docs/architecture.md)."""
