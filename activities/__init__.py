"""Temporal activities: thin I/O against the controller, environments and engines."""
