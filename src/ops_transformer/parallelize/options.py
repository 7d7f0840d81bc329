"""How :func:`~ops_transformer.parallelize` prepares a model: :class:`ParallelOptions`, one frozen,
validated options object (and its LoRA and data-parallel sections, :class:`LoRAOptions`, :class:`DataParallelOptions`). They are defined, torch-free,
in :mod:`ops_transformer.schema.parallel_options` (a run's file and the command line build them
without importing torch); this is their name in ``parallelize``."""

from ..schema.parallel_options import (CHOICES, MOE_STATISTICS, VOCAB_CHOICES, ZERO_STAGES,
                                       DataParallelOptions, LoRAOptions, ParallelOptions,
                                       check_grad_reduce_dtype, check_lora_args)

__all__ = ["CHOICES", "MOE_STATISTICS", "VOCAB_CHOICES", "ZERO_STAGES", "DataParallelOptions",
           "LoRAOptions", "ParallelOptions", "check_grad_reduce_dtype", "check_lora_args"]
