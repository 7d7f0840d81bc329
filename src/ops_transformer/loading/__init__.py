"""Loading a Hugging Face checkpoint straight into its parallel layout (SPEC F15): each rank reads
only its own shards, as blocks of the safetensors files, onto its own device. Above
``parallelize`` (which it calls) and beside ``checkpoint`` (whose shard metadata it reads)."""

from .api import from_pretrained

__all__ = ["from_pretrained"]
