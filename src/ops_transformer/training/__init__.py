"""A training run: its configuration (``config``: ``RunConfig``'s typed sections and their TOML
file), the loop every rank runs and the checks before any rank starts (``loop``: ``TrainConfig``,
``validate``), the optimizer and memory options (``optimizer``), the learning-rate schedule, the
data (bytes, tokenised documents), checkpoints of a run, fine-tuning a Hugging Face model and the
re-planning of a resume on another number of ranks (``rebalance``); :func:`dry_run`
(``meta_run``): what a run builds on each rank, built on ``meta``.

Importing this package imports nothing else; ``training.config`` imports torch through
``ParallelOptions`` (its ``parallel`` section), not yet free of it."""


def __getattr__(name: str):
    if name == "dry_run":  # imported when first used (it imports torch)
        from .meta_run import dry_run

        return dry_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
