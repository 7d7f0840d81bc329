"""The exceptions of the checkpoint package."""


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded or saved: missing, truncated or corrupted files (named), no
    checkpoint at all, one that does not fit the model or optimizer, one that asks to run code
    (:class:`~.reader.UnsafeCheckpointError`), or a save that failed (:class:`NoSpaceError`).
    Raised before anything is loaded, so the model and optimizer are left untouched; a failed save
    leaves no partial checkpoint and every earlier one. A ``ValueError``, so the CLI reports it in
    one line."""


class NoSpaceError(CheckpointError):
    """The file system of a checkpoint (or of an output) has too little space for what would be
    written: found before writing, or when a write failed. The message names the device, the step
    and the size needed."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated, corrupted or unreadable (its manifest, a shard,
    DCP's metadata): that checkpoint is lost, an older one may not be (``train --resume`` falls
    back to the newest that verifies)."""
