"""The Hugging Face model zoo: parallelise a tiny random model of every family whose config ships
a ``base_model_tp_plan`` at tp 2 and compare it with the unsharded model; print the coverage table
and, with ``--write``, put it into docs/huggingface.md (between the zoo-table markers) and the
counts into the README's F14 row.

    .venv/bin/python tools/hf_zoo.py --write              # the whole zoo (~10 min on 2 cores)
    .venv/bin/python tools/hf_zoo.py qwen3 olmo2          # some families
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DOC, README = ROOT / "docs" / "huggingface.md", ROOT / "README.md"
START, END = "<!-- zoo table: start -->", "<!-- zoo table: end -->"


def _rank(model_type: str, tp: int):
    from ops_transformer import init_parallel
    from ops_transformer.testing import zoo as hf_zoo

    return hf_zoo.check_family(model_type, init_parallel(tp=tp), vocab="parallel")


def run(model_type: str, tp: int, timeout: float) -> dict:
    from ops_transformer import launch
    from ops_transformer.testing import zoo as hf_zoo

    errors, exc, start = None, None, time.perf_counter()
    try:
        hf_zoo.prepare(model_type)  # in this process: clean errors, code imported once
        errors = launch(_rank, tp, model_type, tp, timeout=timeout)[0]
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table
        exc = e
    return {"model_type": model_type, "status": hf_zoo.status(exc, errors), "errors": errors,
            "seconds": round(time.perf_counter() - start, 1)}


def table(rows: list[dict], skipped: dict[str, str], version: str) -> str:
    works = sum(r["status"] == "works" for r in rows)
    lines = [f"{works} work, {len(rows) - works} fail, {len(skipped)} not applicable "
             f"(`transformers` {version}, tp 2, fp32).", "",
             "| model type | status | rules | output | gradients | weights after a step |",
             "|---|---|---|---|---|---|"]
    every = sorted([(r["model_type"], r) for r in rows] + [(k, None) for k in skipped])
    for model_type, row in every:
        if row is None:
            lines.append(f"| `{model_type}` | not applicable: {skipped[model_type]} | | | | |")
            continue
        e = row["errors"] or {}
        errs = " | ".join(f"{e[k]:.1e}" if e else "" for k in ("output", "grads", "weights"))
        lines.append(f"| `{model_type}` | {row['status'].replace('|', '/')} | {e.get('split', '')} "
                     f"| {errs} |")
    return "\n".join(lines)


def write(text: str, rows: list[dict]) -> None:
    doc = DOC.read_text()
    if START not in doc:
        raise SystemExit(f"{DOC} has no {START} marker")
    head, rest = doc.split(START, 1)
    DOC.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")
    works = sum(r["status"] == "works" for r in rows)
    readme = README.read_text()
    new = re.sub(r"\d+ of \d+ text families with a `base_model_tp_plan` work \([^)]*\)",
                 f"{works} of {len(rows)} text families with a `base_model_tp_plan` work "
                 f"({len(rows) - works} fail)", readme)
    README.write_text(new)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help="model types (default: all)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per family")
    parser.add_argument("--write", action="store_true", help="update docs and README")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    import transformers

    from ops_transformer.testing import zoo as hf_zoo

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    zoo = hf_zoo.zoo_families()
    names = args.families or sorted(zoo)
    skipped = {k: zoo[k] for k in names if zoo.get(k)}
    rows = []
    for i, model_type in enumerate(n for n in names if not zoo.get(n)):
        row = run(model_type, args.tp, args.timeout)
        rows.append(row)
        print(f"[{i + 1}/{len(names) - len(skipped)}] {model_type:28s} {row['seconds']:6.1f}s "
              f"{row['status']}", file=sys.stderr, flush=True)
    text = table(rows, skipped, transformers.__version__)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write:
        if args.families:
            raise SystemExit("--write needs the whole zoo (no family names)")
        write(text, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
