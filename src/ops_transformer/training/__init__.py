"""A training run: its configuration (``config``: the typed sections, the TOML file, the flags
generated from them), the checks before any rank starts (``preflight``), the loop every rank runs
(``loop``), the optimizer and memory options (``optimizer``), the learning-rate schedule, the data
(bytes, tokenised documents), checkpoints of a run, fine-tuning a Hugging Face model and the
re-planning of a resume on another number of ranks (``rebalance``).

Importing this package imports nothing else: ``training.config`` (and the ``train`` command line
built from it) stay free of torch; the modules that need it import it themselves."""
