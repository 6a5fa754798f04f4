"""Reference implementations built on rollsafe: environments a run can checkpoint."""
