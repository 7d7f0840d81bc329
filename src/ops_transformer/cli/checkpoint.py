"""``ops-transformer checkpoint inspect|export``, and the checkpoint flags of ``train``."""

from __future__ import annotations

import time
from pathlib import Path

from ..utils.progress import format_table
from ._common import print_json, refuse_torchrun, replacing_output
from .train_args import add_checkpoint_arguments, checkpoint_settings  # noqa: F401 (train's)

HELP = "inspect a sharded checkpoint, or export its dense weights"


def add_parser(p) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    inspect = sub.add_parser("inspect", help="steps, layout, sizes and verification status",
                             description="steps, layout, sizes and verification status")
    inspect.add_argument("dir", help="a checkpoint root (train --ckpt-dir) or one step-… directory")
    inspect.add_argument("--no-verify", action="store_true", help="skip the SHA-256 checks")
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")
    export = sub.add_parser("export", help="the dense weights: a .safetensors file, or a "
                            "save_pretrained directory for Hugging Face models",
                            description="the dense weights of one checkpoint")
    export.add_argument("dir", help="a checkpoint root (train --ckpt-dir)")
    export.add_argument("--step", type=int, help="which checkpoint (default: the latest)")
    export.add_argument("--out", required=True, help="a .safetensors file; for a Hugging Face "
                        "model a directory (save_pretrained) unless it ends in .safetensors")
    form = export.add_mutually_exclusive_group()
    form.add_argument("--adapter", action="store_true", help="a LoRA checkpoint's adapters as a "
                      "PEFT adapter directory (PeftModel.from_pretrained(base, OUT) loads it)")
    form.add_argument("--merge", action="store_true", help="a LoRA checkpoint's base with the "
                      "adapters merged: a save_pretrained directory (a .safetensors file for a "
                      "preset GPT)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out "
                        "(written beside it first, then swapped in whole); without it a "
                        "non-empty --out is refused")
    export.add_argument("--base", metavar="DIR", help="with --merge: the base model directory, "
                        "when it is no longer where training read it")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _rows(info: dict) -> list[dict]:
    rows = []
    for c in info["checkpoints"]:
        layout = c.get("layout") or {}
        rows.append({
            "step": c.get("step"),
            "latest": "*" if c.get("step") == info["latest"] else "",
            "layout": ((f"pp={layout['pp']} × " if layout.get("pp", 1) > 1 else "")
                       + f"dp={layout['dp']} × tp={layout['tp']}"
                       + (f" × ep={layout['ep']}" if layout.get("ep", 1) > 1 else "")
                       if layout else "?"),
            "batch": _batch_split(c.get("meta") or {}),
            "model": c.get("model", {}).get("class", "?") + (
                f" + LoRA r{c['model']['lora']['rank']}" if c.get("model", {}).get("lora")
                else ""),
            "optimizer": c.get("optimizer") or "-",
            "size": _size(c["total_bytes"]) if "total_bytes" in c else "?",
            "files": len(c.get("files", {})),
            "saved": (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["created_unix"]))
                      if "created_unix" in c else "?"),
            "status": c["status"],
        })
    return rows


def _batch_split(meta: dict) -> str:
    """``"8 = 2 × 4"``: the global batch as accumulation × micro-batch per rank (``train``'s
    ``meta``), ``"-"`` without it."""
    if "global_batch" not in meta:
        return "-"
    return f"{meta['global_batch']} = {meta['grad_accum']} × {meta['micro_batch']} per rank"


def _inspect(args) -> int:
    from ..checkpoint import export as ex

    info = ex.describe_root(Path(args.dir), check=not args.no_verify)
    if args.json:
        print_json(info)
        _refuse_unsafe(info)
        return 0
    if not info["checkpoints"]:
        print(f"{info['root']}: no checkpoint")
    else:
        print(format_table(_rows(info)))
    for name in info["incomplete"]:
        print(f"incomplete (a save in progress or interrupted; ignored): {name}")
    _refuse_unsafe(info)
    bad = [c for c in info["checkpoints"] if c["status"] not in ("ok", "not verified")]
    return 1 if bad else 0


def _refuse_unsafe(info: dict) -> None:
    """A checkpoint whose pickles ask for more than checkpoints hold is an error (exit 2), after
    the table: it is crafted, not damaged."""
    from ..checkpoint.reader import UnsafeCheckpointError

    unsafe = [c for c in info["checkpoints"] if c.get("unsafe")]
    if unsafe:
        more = f" ({len(unsafe) - 1} more)" if len(unsafe) > 1 else ""
        raise UnsafeCheckpointError(unsafe[0]["status"] + more)


def _export(args) -> int:
    from ..checkpoint import export as ex
    from ..checkpoint import store

    out = Path(args.out)
    path = store.resolve(args.dir, args.step)
    manifest = store.read_manifest(path)  # small: no tensors read
    if args.adapter or args.merge or manifest["model"].get("lora"):
        return _export_lora(args, out, path, manifest)
    huggingface = manifest["model"].get("kind") == "huggingface" and out.suffix != ".safetensors"
    with replacing_output(out, directory=huggingface, overwrite=args.overwrite) as target:
        state, manifest = ex.dense_state_dict(args.dir, args.step)
        if huggingface:
            ex.export_huggingface(state, manifest, target)
            what = f"a save_pretrained directory ({manifest['model']['class']})"
            copied = ex.copied_side_files(manifest)
            if copied:
                what += f" with {', '.join(copied)} from {ex.source_dir(manifest)}"
        else:
            ex.export_safetensors(state, manifest, target)
            what = "a safetensors file"
    print(f"wrote {out}: {what}, {len(state)} tensors of step {manifest['step']}")
    return 0


def _export_lora(args, out: Path, path: Path, manifest: dict) -> int:
    """``--adapter`` / ``--merge`` of a LoRA checkpoint (which holds its adapters only)."""
    from ..checkpoint import adapters as lora_export
    from ..checkpoint import export as ex

    info = lora_export.lora_info(manifest, path)
    if not (args.adapter or args.merge):
        raise ValueError(f"checkpoint {path} holds LoRA adapters only (rank {info['rank']} on "
                         f"{len(info['targets'])} modules): export them with --adapter (a PEFT "
                         f"adapter directory) or --merge (the base with them merged)")
    if args.base and not args.merge:
        raise ValueError("--base applies to --merge (the adapter directory needs no base)")
    directory = args.adapter or manifest["model"].get("kind") == "huggingface"
    with replacing_output(out, directory=directory, overwrite=args.overwrite) as target:
        state, manifest = ex.dense_state_dict(args.dir, args.step)
        if args.adapter:
            lora_export.export_peft_adapter(state, manifest, target, path)
            what = (f"a PEFT adapter directory (rank {info['rank']}, {len(info['targets'])} "
                    f"modules)")
        else:
            lora_export.export_merged(state, manifest, target, path, base_dir=args.base)
            what = (f"the base with {len(info['targets'])} adapters merged"
                    + (" (save_pretrained)" if directory else ""))
    print(f"wrote {out}: {what}, step {manifest['step']}")
    return 0


def run(args) -> int:
    refuse_torchrun("checkpoint", "reads and writes files in one process")
    return _inspect(args) if args.action == "inspect" else _export(args)
