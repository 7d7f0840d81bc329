"""The prepared GPU check (``make gpu-check``): what the first GPU machine must confirm, in ≤ 8 min.

Sections, each in its own process with its own time limit (the whole check stops starting new ones
once its budget, 480 s by default, is spent; a section that fails is recorded and the rest still
run):

* ``cuda_tests``   — ``OT_TEST_DEVICE=cuda pytest -m cuda tests`` (the CUDA variants);
* ``train``        — ``train --preset gpt2-124m --precision bf16 --steps 20`` on one GPU: tokens/s
  and MFU (6·N FLOPs per token plus attention, against the catalogue's bf16 peak for the detected
  GPU);
* ``block``        — one TP=1 Transformer block (hidden 4096, 32 heads, FFN 16384, sequence 2048,
  batch 1), forward + backward under bf16 autocast, timed with CUDA events: achieved TFLOP/s and
  MFU (goal ≥ 50 %);
* ``block_compile`` — the same block eager, compiled (``torch.compile(fullgraph=True)``,
  inductor) and compiled with fp8 linear layers (``precision="fp8"``): tokens/s, TFLOP/s and MFU
  of each, compiled / eager and compiled + fp8 / eager (issue 38);
* ``hf``           — ``generate`` from a tiny Llama and ``embed`` from a tiny BERT written with
  ``save_pretrained`` (bf16), on CUDA;
* ``checkpoint``   — ``train --ckpt-dir`` on CUDA, ``--resume``, then ``checkpoint export`` (which
  loads on the CPU);
* ``calibrate``    — ``calibrate --quick`` on the GPU(s);
* with ≥ 2 GPUs: ``nccl_exactness`` (``OT_TEST_DEVICE=cuda pytest tests/layers``, the exactness
  suite on NCCL) and ``bench_hf_llama`` (``bench_hf_llama.py --sizes small`` against DTensor).

It writes one JSON file (``--out``, default ``runs/gpu-check.json``): the GPU, torch and CUDA
versions, and per section its status (``ok``/``failed``/``skipped``), seconds, figures and the
tail of its output. With no GPU visible it writes nothing and exits 2 with the reason.

    make gpu-check            # = python benchmarks/gpu_check.py --out runs/gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLI = [PY, "-m", "ops_transformer"]
TAIL = 3000


def gpu_info() -> dict:
    from ops_transformer.planner.catalogue import gpu, gpu_for_device

    props = torch.cuda.get_device_properties(0)
    card = gpu_for_device(props.name, props.total_memory)
    return {"name": props.name, "memory_bytes": props.total_memory, "count":
            torch.cuda.device_count(), "catalogue": card,
            "bf16_peak_flops": gpu(card).bf16_flops if card else None,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def run(cmd: list[str], limit: float, env: dict | None = None) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit,
                              env={**os.environ, **(env or {})})
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        rc, out = 124, out + f"\n[timed out after {limit:.0f} s]"
    return rc, out, time.perf_counter() - start


def last_json(text: str) -> dict:
    """The last JSON object printed at the start of a line (commands print their --json result
    last; stderr, appended after stdout, may follow it)."""
    start = text.rfind("\n{") + 1 if "\n{" in text else (0 if text.startswith("{") else -1)
    if start < 0:
        return {}
    return json.JSONDecoder().raw_decode(text[start:])[0]


def section_cuda_tests(limit, info, tmp):
    rc, out, _ = run([PY, "-m", "pytest", "-q", "-m", "cuda", "tests"], limit,
                     {"OT_TEST_DEVICE": "cuda"})
    summary = re.findall(r"=+ (.*?) in [\d.]+s", out)
    return rc, out, {"summary": summary[-1] if summary else None}


def section_train(limit, info, tmp):
    rc, out, _ = run(CLI + ["train", "--preset", "gpt2-124m", "--precision", "bf16", "--steps",
                            "20", "--batch", "8", "--seq", "1024", "--no-progress", "--json",
                            "--out", str(tmp / "train")], limit)
    if rc:
        return rc, out, {}
    m = last_json(out)
    cfg = m["model"]
    per_token = 6 * m["params"] + 6 * cfg["n_layers"] * m["seq"] * cfg["d_model"]  # fwd+bwd
    flops = m["tokens_per_s"] * per_token
    peak = info["bf16_peak_flops"]
    return rc, out, {"tokens_per_s": m["tokens_per_s"], "median_step_s": m["median_step_s"],
                     "achieved_tflops": flops / 1e12, "mfu": flops / peak if peak else None,
                     "loss_first": m["loss_first"], "loss_last": m["loss_last"]}


def section_block(limit, info, tmp):
    rc, out, _ = run([PY, str(Path(__file__).with_name("gpu_block.py"))], limit)
    if rc:
        return rc, out, {}
    m = last_json(out)
    peak = info["bf16_peak_flops"]
    m["mfu"] = m["achieved_flops"] / peak if peak else None
    m["goal_mfu"] = 0.5
    return rc, out, m


def section_block_compile(limit, info, tmp):
    rc, out, _ = run([PY, str(Path(__file__).with_name("gpu_block.py")), "--methods",
                      "eager,compiled,compiled_fp8"], limit)
    if rc:
        return rc, out, {}
    m = last_json(out)
    peak = info["bf16_peak_flops"]
    for figures in m["methods"].values():
        figures["mfu"] = figures["achieved_flops"] / peak if peak else None
    return rc, out, m


def _write_tiny_models(tmp: Path) -> tuple[Path, Path]:
    import transformers as tr

    torch.manual_seed(0)
    llama = tr.LlamaForCausalLM(tr.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)).to(torch.bfloat16)
    bert = tr.BertModel(tr.BertConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=512))
    llama.save_pretrained(tmp / "llama")
    bert.to(torch.bfloat16).save_pretrained(tmp / "bert")
    return tmp / "llama", tmp / "bert"


def section_hf(limit, info, tmp):
    llama, bert = _write_tiny_models(tmp)
    rc, out, s1 = run(CLI + ["generate", "--model", str(llama), "--prompt", "hello",
                             "--max-new-tokens", "16", "--json"], limit / 2)
    if rc:
        return rc, out, {}
    gen = last_json(out)
    rc, out2, s2 = run(CLI + ["embed", "--model", str(bert), "--text", "a cat", "--text",
                              "a dog", "--json"], limit / 2)
    figures = {"generate_s": s1, "generated_tokens": len(gen.get("new_token_ids", []))}
    if rc == 0:
        figures.update(embed_s=s2, embed_dim=last_json(out2).get("dim"))
    return rc, out + out2, figures


def section_checkpoint(limit, info, tmp):
    ckpt = tmp / "ckpt"
    base = CLI + ["train", "--preset", "tiny", "--no-progress", "--json", "--ckpt-dir", str(ckpt),
                  "--save-every", "2"]
    rc, out, t1 = run(base + ["--steps", "4", "--out", str(tmp / "ckpt-run")], limit / 3)
    if rc:
        return rc, out, {}
    rc, out2, t2 = run(base + ["--steps", "6", "--resume", "--out", str(tmp / "ckpt-resume")],
                       limit / 3)
    if rc:
        return rc, out + out2, {}
    rc, out3, t3 = run(CLI + ["checkpoint", "export", str(ckpt), "--out",
                              str(tmp / "export.safetensors")],
                       limit / 3, {"CUDA_VISIBLE_DEVICES": ""})  # the CPU side of the check
    return rc, out + out2 + out3, {"save_s": t1, "resume_s": t2, "export_on_cpu_s": t3}


def section_calibrate(limit, info, tmp):
    sizes = "1,2" if info["count"] >= 2 else "1"
    rc, out, _ = run(CLI + ["calibrate", "--quick", "--no-progress", "--json", "--world-sizes",
                            sizes, "--out", str(tmp / "profile.json")], limit)
    return rc, out, ({"profile": last_json(out)} if rc == 0 else {})


def section_nccl_exactness(limit, info, tmp):
    rc, out, _ = run([PY, "-m", "pytest", "-q", "tests/layers"], limit, {"OT_TEST_DEVICE": "cuda"})
    summary = re.findall(r"=+ (.*?) in [\d.]+s", out)
    return rc, out, {"summary": summary[-1] if summary else None}


def section_bench_hf_llama(limit, info, tmp):
    path = tmp / "hf_llama.json"
    rc, out, _ = run([PY, "benchmarks/bench_hf_llama.py", "--sizes", "small", "--rounds", "3",
                      "--json", str(path)], limit)
    return rc, out, (json.loads(path.read_text()) if rc == 0 and path.exists() else {})


SECTIONS = [  # (name, function, seconds, GPUs needed)
    ("cuda_tests", section_cuda_tests, 90, 1),
    ("train", section_train, 90, 1),
    ("block", section_block, 60, 1),
    ("block_compile", section_block_compile, 150, 1),
    ("hf", section_hf, 60, 1),
    ("checkpoint", section_checkpoint, 60, 1),
    ("calibrate", section_calibrate, 60, 1),
    ("nccl_exactness", section_nccl_exactness, 60, 2),
    ("bench_hf_llama", section_bench_hf_llama, 60, 2),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu-check.json", help="the JSON file of results")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all sections")
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu-check: no GPU is visible (torch.cuda.device_count() == 0; torch "
              f"{torch.__version__}, {build}): nothing was measured, nothing written. Run it on "
              f"a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    names = [s[0] for s in SECTIONS]
    only = args.only.split(",") if args.only else names
    unknown = [n for n in only if n not in names]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {names}")
    info = gpu_info()
    results = {"gpu": info, "budget_s": args.budget, "sections": {}}
    deadline = time.perf_counter() + args.budget
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name, fn, seconds, gpus in SECTIONS:
            entry = results["sections"][name] = {"status": "skipped"}
            left = deadline - time.perf_counter()
            if name not in only:
                entry["reason"] = "not in --only"
            elif info["count"] < gpus:
                entry["reason"] = f"needs {gpus} GPUs, {info['count']} visible"
            elif left < 10:
                entry["reason"] = f"the {args.budget:.0f} s budget is spent"
            else:
                start = time.perf_counter()
                try:
                    rc, out, figures = fn(min(seconds, left), info, Path(tmp))
                except Exception as exc:  # noqa: BLE001 - recorded, the other sections still run
                    rc, out, figures = 1, f"{type(exc).__name__}: {exc}", {}
                entry.update(status="ok" if rc == 0 else "failed", rc=rc, figures=figures,
                             seconds=round(time.perf_counter() - start, 1), output_tail=out[-TAIL:])
            print(f"gpu-check {name}: {entry['status']} {entry.get('figures', '')}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    failed = [n for n, e in results["sections"].items() if e["status"] == "failed"]
    print(f"gpu-check: wrote {out}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
