"""`boundary-kv`: standard decoding plus boundary frames — the residual at the end of every chunk
with the metadata a later reader needs to trust it — written to an archive."""

from larql.kv.boundary.archive import (
    BoundaryArchive,
    BoundaryArchiveError,
    DirectoryBoundaryArchive,
    InMemoryBoundaryArchive,
)
from larql.kv.boundary.engine import BoundaryKvEngine
from larql.kv.boundary.entry import ENTRY
from larql.kv.boundary.frames import BoundaryFormatError, BoundaryFrame

__all__ = [
    "ENTRY",
    "BoundaryArchive",
    "BoundaryArchiveError",
    "BoundaryFormatError",
    "BoundaryFrame",
    "BoundaryKvEngine",
    "DirectoryBoundaryArchive",
    "InMemoryBoundaryArchive",
]
