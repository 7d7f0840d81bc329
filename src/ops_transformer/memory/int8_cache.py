"""An 8-bit activation cache: tensors saved for backward are kept as int8 with one scale per block.

Inside ``with Int8ActivationCache():`` every floating-point activation that autograd saves for
backward is quantised as it is saved and dequantised when backward needs it::

    blocks of `block_size` elements (in memory order, the last one zero-padded)
    scale_k = max |x| over block k / 127                  (fp32, one per block)
    q       = round(x / scale_k)  ∈ [-127, 127]            (int8)
    x̂      = q · scale_k          (back in x's dtype and shape; strides too unless x was strided
                                   with gaps, e.g. half of a fused projection: then contiguous)

Per element ``|x̂ − x| ≤ scale_k / 2 = max|block_k| / 254`` (plus the rounding of ``x̂`` to x's dtype).
Storage: ``1 + 4/block_size`` bytes per element instead of 4 (fp32) or 2 (bf16/fp16).

What stays exact: integer and boolean tensors (indices, masks), tensors below ``min_numel``
elements, expanded tensors (a stride of 0), and tensors autograd did not produce — parameters and views of them, and leaves such as
float dropout masks, softmax log-sum-exps and RoPE tables (no ``grad_fn``): they live anyway or are
small, and some (a log-sum-exp) turn a small absolute error into a large relative one.

Built on :func:`torch.autograd.graph.saved_tensors_hooks`, so it applies to whatever runs inside the
``with`` block, including the inputs that activation checkpointing keeps. ``parallelize(...,
activation_cache="int8")`` enters it around every Transformer layer (not around the loss, whose
saved log-probabilities are too sensitive).
"""

from __future__ import annotations

import weakref

import torch

from . import measure


class _Packed:
    """One quantised tensor: int8 codes, fp32 block scales and what is needed to rebuild it."""

    __slots__ = ("codes", "scales", "shape", "stride", "dtype", "numel", "version")

    def __init__(self, x: torch.Tensor, block_size: int):
        self.version = x._version
        if not _is_dense(x):  # e.g. one half of a fused projection: rebuilt contiguous
            x = x.contiguous()
        self.shape, self.stride, self.dtype, self.numel = x.shape, x.stride(), x.dtype, x.numel()
        flat = _memory_order(x).reshape(-1).float()
        pad = -flat.numel() % block_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks = flat.view(-1, block_size)  # (n_blocks, block_size)
        self.scales = blocks.abs().amax(1, keepdim=True).div_(127.0)  # (n_blocks, 1)
        safe = torch.where(self.scales > 0, self.scales, torch.ones_like(self.scales))
        self.codes = blocks.div(safe).round_().clamp_(-127, 127).to(torch.int8)

    def unpack(self) -> torch.Tensor:
        values = (self.codes.float() * self.scales).reshape(-1)[:self.numel].to(self.dtype)
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                  device=self.codes.device)
        _memory_order(out).view(-1).copy_(values)
        return out

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def _memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dimensions permuted so that it is contiguous (for a dense tensor)."""
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d]))
    return x.permute(order)


def _is_dense(x: torch.Tensor) -> bool:
    return _memory_order(x).is_contiguous()


def _overlaps(x: torch.Tensor) -> bool:
    """An expanded tensor (a stride of 0): packing would materialise every repeat."""
    return any(stride == 0 and size > 1 for stride, size in zip(x.stride(), x.shape))


def _produced_by_autograd(x: torch.Tensor) -> bool:
    """An activation: computed from the parameters (has a ``grad_fn``) and not a view of a leaf
    that requires grad (a parameter's transpose saved by a linear layer is a view of one). A view
    whose base is a leaf that does *not* require grad is an activation too: a custom autograd
    function's output — the tensor-parallel linears' at tp > 1 — is a view of what ``F.linear``
    computed under no-grad inside ``forward`` (a 3-d input's matmul reshaped)."""
    if x.grad_fn is None:
        return False
    base = x._base
    return base is None or not (base.is_leaf and base.requires_grad)


class Int8ActivationCache:
    """Context manager: activations saved for backward inside it are stored as int8 with one absmax
    scale per ``block_size`` elements, and dequantised in backward. See the module docstring for
    what is quantised, what stays exact and the error bound. Reusable and re-entrant.

    >>> with Int8ActivationCache(block_size=128):
    ...     loss = model(x, y)[1]
    >>> loss.backward()          # outside is fine: the packed tensors travel with the graph

    ``stats`` counts, since construction, the tensors quantised and kept and their bytes.
    """

    def __init__(self, block_size: int = 128, *, min_numel: int = 1024):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative integer, got {min_numel!r}")
        self.block_size, self.min_numel = block_size, min_numel
        self.stats = {"quantised": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
        self._contexts: list = []
        self._seen: dict[int, tuple[weakref.ref, _Packed]] = {}

    def quantises(self, x: torch.Tensor) -> bool:
        """Whether a tensor saved for backward would be stored as int8."""
        return (x.is_floating_point() and x.numel() >= max(self.min_numel, 1)
                and _produced_by_autograd(x) and not _overlaps(x))

    def _pack(self, x: torch.Tensor):
        if not self.quantises(x):
            self.stats["kept"] += 1
            measure.notify_saved(x)
            return x
        packed = self._shared(x)
        if packed is None:
            packed = _Packed(x, self.block_size)
            self._remember(x, packed)
            self.stats["quantised"] += 1
            self.stats["bytes_before"] += x.numel() * x.element_size()
            self.stats["bytes_after"] += packed.nbytes
            measure.notify_saved(packed.codes, packed.scales)
        return packed

    @staticmethod
    def _unpack(saved):
        return saved.unpack() if isinstance(saved, _Packed) else saved

    def _shared(self, x: torch.Tensor) -> _Packed | None:
        """The packed copy of this very tensor object if it was saved before (Q, K and V all save
        their common input): keyed by object identity, checked through a weak reference, so a
        freed tensor's id or address can never alias another one, and by version, so a tensor
        changed in place since is packed again."""
        entry = self._seen.get(id(x))
        if entry is None or entry[0]() is not x or entry[1].version != x._version:
            return None
        return entry[1]

    def _remember(self, x: torch.Tensor, packed: _Packed) -> None:
        key = id(x)
        self._seen[key] = (weakref.ref(x, lambda _, key=key: self._seen.pop(key, None)), packed)

    def __enter__(self) -> Int8ActivationCache:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._contexts.append(hooks)
        return self

    def __exit__(self, *exc) -> None:
        self._contexts.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"Int8ActivationCache(block_size={self.block_size}, min_numel={self.min_numel})"


def quantisation_error_bound(x: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """The per-element bound ``max|block| / 254`` of the cache's error for ``x`` (same shape)."""
    flat = _memory_order(x).reshape(-1).float()
    pad = -flat.numel() % block_size
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block_size)
    bound = (blocks.abs().amax(1, keepdim=True) / 254).expand_as(blocks).reshape(-1)
    out = torch.empty_like(x, dtype=torch.float32)
    _memory_order(out).view(-1).copy_(bound[:x.numel()])
    return out
