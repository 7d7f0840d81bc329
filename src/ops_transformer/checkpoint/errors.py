"""The one exception of the checkpoint package."""


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing, truncated or corrupted files (named), no
    checkpoint at all, or one that does not fit the model or optimizer. Raised before anything
    is loaded, so the model and optimizer are left untouched. A ``ValueError``, so the CLI
    reports it in one line."""
