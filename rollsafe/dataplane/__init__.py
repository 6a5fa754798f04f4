"""Data plane: where rollout rows live (DESIGN.md section 9)."""

from rollsafe.dataplane.protocol import DataPlane, Row, row_digest

__all__ = ["DataPlane", "Row", "make_dataplane", "row_digest"]


def make_dataplane(name: str) -> DataPlane:
    """A fresh, empty data plane of the named backend."""
    from rollsafe.errors import InvalidInput

    if name == "memory":
        from rollsafe.dataplane.memory import MemoryDataPlane

        return MemoryDataPlane()
    raise InvalidInput(f"unknown data plane {name!r} (available: memory)")
