"""A training run: its configuration (``config``: ``RunConfig``'s typed sections and their TOML
file), the loop every rank runs and the checks before any rank starts (``loop``: ``TrainConfig``,
``validate``), the optimizer and memory options (``optimizer``), the learning-rate schedule, the
data (bytes, tokenised documents), checkpoints of a run, fine-tuning a Hugging Face model and the
re-planning of a resume on another number of ranks (``rebalance``).

Importing this package imports nothing else; ``training.config`` imports torch through
``ParallelOptions`` (its ``parallel`` section), not yet free of it."""
