"""``prefixserve serve``'s Files and Batch options, apart from their routes: the Ray replicas take them
too (each keeps its files and batches in a folder of its own)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.entrypoints.openai.files import MAX_FILE_BYTES
from prefixserve.scheduler.offline import GROUPINGS


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """``prefixserve serve``'s Files and Batch options. ``files_dir``: where files and batches are
    kept (None: a temporary folder removed at exit, so nothing outlives the server);
    ``concurrency``: rows in flight at once over all batches (None: twice the engine's max_num_seqs,
    so the engine always has the next rows queued and the queue keeps room for live requests);
    ``tag``: written into every file and batch id
    (the Ray ingress routes by it)."""

    files_dir: str | None = None
    max_file_bytes: int = MAX_FILE_BYTES
    concurrency: int | None = None
    grouping: str = "first_level"  # or "tree", or "none": the file's order
    tag: str | None = None

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1:
            raise ValueError(f"--max-file-bytes must be >= 1, got {self.max_file_bytes}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--batch-concurrency must be >= 1, got {self.concurrency}")
        if self.grouping not in (*GROUPINGS, "none"):
            raise ValueError(f"--batch-grouping must be one of {', '.join((*GROUPINGS, 'none'))}")


__all__ = ["BatchSettings"]
