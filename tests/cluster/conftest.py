"""Multi-node tests: a Ray cluster of several `ray start` nodes on this machine
(rollsafe.testing.raycluster), its own Temporal dev server, workers as processes and as
actors. Each test starts and stops everything itself, so it can check that every process it
started is gone."""
