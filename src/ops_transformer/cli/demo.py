"""``ops-transformer demo``: the layers at work on local ranks, checked against one process.

A small next-token model — vocab-parallel embedding, a column→row MLP block with a residual, a
column-parallel LM head and the vocab-parallel loss — trains for a few SGD steps at ``tp`` ranks;
the same dense model trains in the parent process. It prints both loss curves, their largest
relative difference and the communication per step next to what the partition predicts.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.ledger import CommLedger
from ..layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                      vocab_parallel_cross_entropy)
from ..parallel import init_parallel, launch

HELP = "train a small model with tensor-parallel layers on local ranks and check it is exact"


def add_parser(p) -> None:
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--steps", type=int, default=8, help="SGD steps (default 8)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


class TinyLM(nn.Module):
    """Single-device reference: embed → x + MLP(x) → LM head."""

    def __init__(self, vocab=64, dim=32, ffn=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def hidden(self, idx):
        x = self.embed(idx)
        return x + self.fc2(F.gelu(self.fc1(x)))  # (B, T, dim)

    def forward(self, idx, targets):
        logits = self.head(self.hidden(idx))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _parallelize(model: TinyLM, ctx) -> TinyLM:
    model.embed = VocabParallelEmbedding.from_dense(model.embed, ctx)
    model.fc1 = ColumnParallelLinear.from_dense(model.fc1, ctx)
    model.fc2 = RowParallelLinear.from_dense(model.fc2, ctx)
    model.head = ColumnParallelLinear.from_dense(model.head, ctx)  # logits stay vocab-sharded
    return model


def _batch(step: int, vocab=64, batch=8, seq=16):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], (idx[:, 1:] * 7 + 3) % vocab  # a learnable mapping


def _train(model, steps, loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, comm = [], None
    for step in range(steps):
        idx, targets = _batch(step)
        with CommLedger() as ledger:
            loss = loss_fn(model, idx, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        comm = ledger.summary()
    return losses, comm


def _rank_main(tp, steps):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = _parallelize(TinyLM(), ctx)
    start = time.perf_counter()
    losses, comm = _train(model, steps, lambda m, i, t: vocab_parallel_cross_entropy(
        m.head(m.hidden(i)), t, ctx))
    return losses, comm, time.perf_counter() - start


def run(args) -> int:
    if args.tp < 1 or args.steps < 1:
        raise ValueError(f"--tp ({args.tp}) and --steps ({args.steps}) must be at least 1")
    if 64 % args.tp or 32 % args.tp:
        raise ValueError(f"--tp ({args.tp}) must divide the demo's vocab (64) and width (32)")
    print(f"demo: training TinyLM at tp={args.tp} on {args.tp} local ranks and on one process ...",
          flush=True)
    torch.manual_seed(0)
    dense_losses, _ = _train(TinyLM(), args.steps, lambda m, i, t: m(i, t))
    tp_losses, comm, seconds = launch(_rank_main, args.tp, args.tp, args.steps)[0]
    rel = max(abs(a - b) / abs(b) for a, b in zip(tp_losses, dense_losses))
    tokens = 8 * 16
    # forward: embedding, fc2 (row), loss max + loss sums; backward: input grads of fc1 and head
    expected = {"all_reduce": 4 + 2 if args.tp > 1 else 0}
    result = {"tp": args.tp, "steps": args.steps, "loss_first": tp_losses[0],
              "loss_last": tp_losses[-1], "max_rel_loss_diff_vs_dense": rel,
              "comm_per_step": comm, "expected_allreduce_per_step": expected["all_reduce"],
              "tokens_per_s": tokens * args.steps / seconds}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'step':>4}  {'loss tp=' + str(args.tp):>12}  {'loss dense':>12}")
    for step, (a, b) in enumerate(zip(tp_losses, dense_losses)):
        print(f"{step:>4}  {a:>12.6f}  {b:>12.6f}")
    print(f"largest relative loss difference vs one process: {rel:.2e}")
    for kind, c in (comm or {}).items():
        print(f"communication per step: {kind}: {c['calls']} calls, {c['elements']} elements "
              f"({c['bytes'] / 1024:.1f} KiB); partition predicts {expected.get(kind, '?')} calls")
    print(f"throughput: {result['tokens_per_s']:.0f} tokens/s on {args.tp} CPU ranks")
    return 0 if rel <= 1e-5 else 1
