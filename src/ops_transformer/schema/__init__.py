"""The vocabulary of the options, torch-free: what each option may be (:mod:`.choices`), the
options ``parallelize`` takes (:mod:`.parallel_options`: ``ParallelOptions``, ``LoRAOptions``) and
the checks of a rank grid's degrees (:mod:`.mesh`). On the ground floor: the layers above import
their choices from here, and the command line and a run's file (``training/config.py``) build and
check their options without importing torch (``ops-transformer train --help`` and an argument error
start no torch)."""
