"""``ops-transformer embed``: sentence embeddings from a local Hugging Face encoder, tensor-parallel.

Mean pooling over the attention mask, then L2 normalisation (the sentence-transformers recipe of
all-MiniLM-L6-v2); prints the pairwise cosine similarities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import add_launch_timeout, launch_timeout, print_json
from ._hf import check_model_dir, check_split, load_parallel, load_tokenizer, run_on_ranks

HELP = "sentence embeddings from a local Hugging Face encoder split over tp ranks"


def add_parser(p) -> None:
    p.add_argument("--model", required=True, help="a local model directory (save_pretrained)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--nproc", type=int, help="local ranks to launch (default: --tp)")
    p.add_argument("--text", action="append", required=True, help="a sentence (repeat the flag)")
    p.add_argument("--json", action="store_true")
    add_launch_timeout(p)


def mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9), dim=-1)


def _worker(root, tp, texts):
    ctx, model = load_parallel(root, "AutoModel", tp)
    with ctx:
        encoded = load_tokenizer(root)(texts, padding=True, return_tensors="pt")
        batch = {k: torch.as_tensor(v).to(ctx.device) for k, v in encoded.items()
                 if k in ("input_ids", "attention_mask", "token_type_ids")}
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
    if ctx.rank != 0:
        return None
    emb = mean_pooled(hidden, batch["attention_mask"]).cpu()
    return {"tp": ctx.tp_size, "texts": texts, "dim": emb.shape[-1],
            "similarity": (emb @ emb.T).tolist(), "embeddings": emb.tolist()}


def run(args) -> int:
    if any(not t for t in args.text):
        raise ValueError("--text is empty: give a sentence to embed")
    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {args.tp}")
    root, config = check_model_dir(args.model, "embed")
    check_split(config, "AutoModel", args.tp, "embed")
    result = run_on_ranks(_worker, args.tp, args.nproc, root, args.tp, args.text,
                          timeout=launch_timeout(args))
    if result is None:  # not rank 0 of a torchrun job
        return 0
    if args.json:
        print_json(result)
        return 0
    texts = result["texts"]
    print(f"{len(texts)} embeddings of dimension {result['dim']} at tp={result['tp']}; "
          f"cosine similarity:")
    for i, row in enumerate(result["similarity"]):  # (a sign column: negatives align)
        print(f"  [{i}] " + "  ".join(f"{v:7.4f}" for v in row) + f"   {texts[i]}")
    return 0
