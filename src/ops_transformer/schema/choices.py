"""What each option may be: one definition of every vocabulary, imported by the modules where the
option takes effect (re-exported there under the same names) and by the command line."""

from __future__ import annotations

ATTENTION_STRATEGIES = ("heads", "heads_allgather", "kv_split", "naive")  # SPEC F5
ATTENTION_CHOICES = ("auto",) + ATTENTION_STRATEGIES  # auto: the cost model chooses
VOCAB_MODES = ("parallel", "replicated")
VOCAB_CHOICES = ("auto",) + VOCAB_MODES
SEQUENCE_PARALLEL_VALUES = (False, True, "regather")
RECOMPUTE = ("none", "selective", "full")
ACTIVATION_CACHES = ("none", "int8")
OVERLAP_MODES = ("none", "chunked", "auto")
MOE_STATISTICS = ("local", "global")
CP_STRATEGIES = ("ring", "allgather_kv")  # what ``auto`` chooses between
ULYSSES = "ulysses"  # all-to-all over heads: forced only (cp must divide the KV heads)
CP_CHOICES = ("auto",) + CP_STRATEGIES + (ULYSSES,)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_BACKWARDS = ("e5m2", "fp32")  # --fp8-backward: the gradients in e5m2, or fp32 products
ZERO_STAGES = (0, 1, 2, 3)  # what train runs (3: FSDP2, ``memory.fsdp.shard_parameters``)
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # as data-parallel buckets (DDP's bucket_cap_mb)
# pipeline schedule name -> (torch.distributed.pipelining class name, stages per rank: "one" |
# "many", placement: "loop" | "v")
PIPELINE_SCHEDULES: dict[str, tuple[str, str, str]] = {
    "gpipe": ("ScheduleGPipe", "one", "loop"),
    "1f1b": ("Schedule1F1B", "one", "loop"),
    "interleaved": ("ScheduleInterleaved1F1B", "many", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "many", "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "many", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "many", "v"),
}
