"""TensorBoard scalars for a training run (``train --tensorboard DIR``).

:class:`ScalarLog` writes one event file in ``DIR`` through ``torch.utils.tensorboard`` (the
``tensorboard`` package, installed with the ``profiler`` extra): each :meth:`ScalarLog.log` call
adds its scalars at a global step. With ``log_dir=None`` it does nothing, so the training loop need not
branch on the rank. View with ``tensorboard --logdir DIR``.
"""

from __future__ import annotations

from pathlib import Path


def check_log_dir(log_dir: str | None) -> None:
    """A clear error before any rank starts: the directory must be creatable and ``tensorboard``
    importable."""
    if log_dir is None:
        return
    path = Path(log_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--tensorboard {log_dir!r} exists and is not a directory")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install "
                         "'ops-transformer[profiler]' (make install does)") from None


class ScalarLog:
    """Scalars by name at a step, into ``log_dir`` (nothing when ``log_dir`` is ``None``)."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, **scalars: float | None) -> None:
        """Add every scalar that is not ``None`` at ``step`` (a name like ``comm/bytes`` groups
        the charts)."""
        if self.writer is None:
            return
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, float(value), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
