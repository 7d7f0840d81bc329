"""An interrupted ``train`` (Ctrl-C, or SIGTERM of the launcher): what it did is kept and said.

Rank 0 reports its losses to a :class:`Journal` as it trains (directly when the ranks run in
this process; through a pipe read by a thread when they are local ranks). On ``SIGINT`` (a
``KeyboardInterrupt``) or ``SIGTERM`` (:func:`terminate_as_interrupt` turns it into
:class:`Interrupted`), the ranks are reaped as before, then :func:`report_interrupt` writes the
metrics and the loss plot so far to ``--out`` (nothing when no step ran: the empty ``--out`` the
run created is removed), prints one line naming the last checkpoint and the command that resumes
it, and returns the exit code a shell gives such a signal (130, 143).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import shlex
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """SIGTERM, raised where the main thread is (as SIGINT raises ``KeyboardInterrupt``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def terminate_as_interrupt():
    """While the block runs, SIGTERM raises :class:`Interrupted` (main thread only; a SIGTERM
    that is ignored stays ignored). ``launch`` reaps its ranks first, then delivers the signal
    here again."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) in (signal.SIG_IGN, None):
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the report
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Journal:
    """Rank 0's progress, as ``train_worker`` reports it (``send``)."""

    def __init__(self):
        self.first = 0
        self.losses: list[float] = []

    def send(self, message: dict) -> None:
        if "start" in message:  # a (re)start: what the checkpoint it resumed from carried
            self.first, self.losses = message["start"], list(message["losses"])
        else:
            self.losses.append(message["loss"])

    @contextlib.contextmanager
    def pipe(self):
        """A connection for local ranks to ``send`` to, read here by a thread while the block
        runs."""
        reader, writer = mp.Pipe(duplex=False)
        done = threading.Event()

        def pump():
            while not done.is_set() or reader.poll():
                try:
                    if reader.poll(0.05):
                        self.send(reader.recv())
                except (EOFError, OSError):
                    return

        thread = threading.Thread(target=pump, name="train-journal", daemon=True)
        thread.start()
        try:
            yield writer
        finally:
            done.set()
            thread.join(2.0)
            writer.close()
            reader.close()


def resume_command(argv: list[str], out: str) -> str:
    """The command line that continues this run: its own arguments with ``--resume`` (and the
    ``--out`` it wrote, when that was a default)."""
    args = list(argv)
    if "--resume" not in args:
        args.append("--resume")
    if "--out" not in args and not any(a.startswith("--out=") for a in args):
        args += ["--out", out]
    return shlex.join(["ops-transformer", *args])


def report_interrupt(cfg, signum: int, journal: Journal, argv: list[str], world: int,
                     progress: bool) -> int:
    """Write what the interrupted run did, say it in one line; return the exit code."""
    from ..checkpoint.store import latest_step, step_dirname
    from ..training.loop import write_outputs

    name = signal.Signals(signum).name
    last = latest_step(cfg.ckpt_dir) if cfg.ckpt_dir else None
    checkpoint = None if last is None else str(Path(cfg.ckpt_dir) / step_dirname(last))
    command = resume_command(argv, cfg.out)
    losses = journal.losses
    done = len(losses)  # the resumed steps' losses included
    wrote = ""
    if losses and cfg.out:
        dp = cfg.dp or max(1, world // (cfg.tp * cfg.ep))
        metrics = {"interrupted": name, "steps_done": len(losses), "steps": cfg.steps,
                   "resumed_from": journal.first or None, "last_checkpoint": checkpoint,
                   "resume_command": command if checkpoint else None,
                   "preset": None if cfg.model else cfg.preset, "model_dir": cfg.model,
                   "tp": cfg.tp, "dp": dp, "ep": cfg.ep, "batch": cfg.batch, "seq": cfg.seq,
                   "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
                   "config": asdict(cfg)}
        try:
            write_outputs(Path(cfg.out), metrics)
            wrote = f"; metrics and loss plot so far in {cfg.out}"
        except (OSError, ValueError) as exc:
            wrote = f"; metrics not written ({exc})"
    if checkpoint:
        tail = f"; last checkpoint {checkpoint} (step {last}); resume with: {command}"
    elif cfg.ckpt_dir:
        tail = f"; no checkpoint in {cfg.ckpt_dir} yet; {command} starts it again"
    else:
        tail = "; no checkpoint (no --ckpt-dir): nothing to resume from"
    lead = "\n" if progress and sys.stderr.isatty() else ""  # after the progress bar's line
    print(f"{lead}ops-transformer train: interrupted ({name}) after step {done} of "
          f"{cfg.steps}{wrote}{tail}", file=sys.stderr, flush=True)
    return EXIT_CODES.get(signum, 128 + signum)

