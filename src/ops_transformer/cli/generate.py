"""``ops-transformer generate``: text from a local Hugging Face causal LM, tensor-parallel."""

from __future__ import annotations

import torch

from ._common import add_launch_timeout, launch_timeout, print_json
from ._hf import (check_causal_lm, check_model_dir, check_split, load_parallel, load_tokenizer,
                  run_on_ranks)

HELP = "generate text with a local Hugging Face causal LM split over tp ranks"


def add_parser(p) -> None:
    p.add_argument("--model", required=True, help="a local model directory (save_pretrained)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--nproc", type=int, help="local ranks to launch (default: --tp; without it "
                   "under torchrun)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_launch_timeout(p)


def _worker(root, tp, prompt, max_new_tokens, temperature, seed):
    ctx, model = load_parallel(root, "AutoModelForCausalLM", tp)
    with ctx:
        result = _generate(model, root, prompt, max_new_tokens, temperature, seed, ctx.device)
    return dict(result, tp=ctx.tp_size) if ctx.rank == 0 else None


def _generate(model, root, prompt, max_new_tokens, temperature, seed, device) -> dict:
    tokenizer = load_tokenizer(root)
    inputs = tokenizer([prompt], return_tensors="pt")
    ids = torch.as_tensor(inputs["input_ids"]).to(device)
    vocab = model.config.vocab_size
    if int(ids.max()) >= vocab:
        raise ValueError(f"the prompt has token id {int(ids.max())}, outside the model's "
                         f"vocabulary of {vocab}")
    torch.manual_seed(seed)  # the same draws on every rank
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
        {"do_sample": False}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         pad_token_id=model.config.eos_token_id or 0, **sampling)
    new = out[0, ids.shape[1]:].tolist()
    return {"prompt": prompt, "new_token_ids": new, "text": tokenizer.decode(new)}


def run(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty: give the text to continue")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")
    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {args.tp}")
    root, config = check_model_dir(args.model, "generate")
    check_causal_lm(root, config)
    check_split(config, "AutoModelForCausalLM", args.tp, "generate")
    result = run_on_ranks(_worker, args.tp, args.nproc, root, args.tp, args.prompt,
                          args.max_new_tokens, args.temperature, args.seed,
                          timeout=launch_timeout(args))
    if result is None:  # not rank 0 of a torchrun job
        return 0
    if args.json:
        print_json(result)
    else:
        print(f"{args.prompt}{result['text']}")
    return 0
