"""The checkpoint service: the controller that runs a snapshot's phases and a restore, the run's
participants in them, and the controller's Ray actor (docs/architecture.md)."""
