"""Helpers for tests and drills that need real processes (not imported by the library)."""
