"""The pure core: a run's state and its rules, with no I/O of their own (docs/architecture.md).

Imports neither Temporal, Ray, nor any HTTP library (tests/unit/test_import_graph.py)."""
