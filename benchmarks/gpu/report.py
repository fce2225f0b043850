"""The table of ``benchmarks/gpu/check.sh``: reads a check directory (``status.tsv`` written by the shell,
``cuda_tests.xml`` from pytest, ``bench.json`` and ``calibration.json`` from ``bench.py``, the trainer's
``train/summary.json``), prints one Markdown table (also written as ``table.md``) and exits 1 if a check
failed.

    python benchmarks/gpu/report.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _status(out_dir: Path) -> dict[str, tuple[int, float]]:
    rows = {}
    path = out_dir / "status.tsv"
    if path.is_file():
        for line in path.read_text().splitlines():
            step, rc, seconds = line.split("\t")
            rows[step] = (int(rc), float(seconds))
    return rows


def _tests(out_dir: Path) -> tuple[str, str]:
    path = out_dir / "cuda_tests.xml"
    if not path.is_file():
        return "FAIL", "no pytest report"
    suites = ET.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    detail = f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
    if n["failures"] + n["errors"]:
        return "FAIL", detail
    return ("PASS" if passed else "SKIP (no GPU)"), detail


def _model_row(m: dict, target: float | None) -> tuple[str, str]:
    parts = [
        f"{m['tflops']:.1f} TFLOP/s",
        f"fwd {m['forward_s'] * 1e3:.2f} ms + bwd {m['backward_s'] * 1e3:.2f} ms",
    ]
    parts.append(f"{m['mfu_measured']:.0%} of the measured bf16 matmul")
    parts.append("fused varlen_attn" if m["fused_varlen"] else "reference attention")
    if m["mfu"] is None:
        return "n/a (no datasheet peak)", "; ".join(parts)
    verdict = f"MFU {m['mfu']:.1%}"
    if target is not None:
        verdict = ("PASS " if m["mfu"] >= target else "FAIL ") + verdict + f" (target >= {target:.0%})"
    return verdict, "; ".join(parts)


def report(out_dir: Path) -> tuple[str, bool]:
    """The check's table (Markdown) and whether every check passed."""
    status = _status(out_dir)
    rows, ok = [], True

    def row(name: str, verdict: str, detail: str, step: str | None = None) -> None:
        nonlocal ok
        if step is not None and step in status:
            detail += f" [{status[step][1]:.0f} s]"
            if status[step][0] != 0 and not verdict.startswith("FAIL"):
                verdict = f"FAIL (exit {status[step][0]})"
        ok &= not verdict.startswith("FAIL")
        rows.append(f"| {name} | {verdict} | {detail} |")

    verdict, detail = _tests(out_dir)
    row("CUDA tests (pytest -m cuda)", verdict, detail, "tests")
    bench_path = out_dir / "bench.json"
    if bench_path.is_file():
        b = json.loads(bench_path.read_text())
        llm, vit = b["models"]["llm_block"], b["models"]["vit_block"]
        c = llm["config"]
        row(f"LLM block bf16, dim {c['dim']}, {c['n_heads']}/{c['n_kv_heads']} heads, ffn {c['ffn_dim']}, "
            f"{llm['pack_tokens']}-token packs of {len(llm['docs'])} docs, on {b['device']}",
            *_model_row(llm, b["llm_target_mfu"]), "bench")  # fmt: skip
        c = vit["config"]
        row(f"ViT block bf16, dim {c['dim']}, {c['n_heads']} heads, {vit['pack_tokens']}-patch packs of "
            f"{len(vit['docs'])} images", *_model_row(vit, None))  # fmt: skip
        cal = json.loads((out_dir / "calibration.json").read_text())
        n = sum(len(layer["records"]) for layer in cal["layers"].values())
        row("per-layer calibration", "written", f"{out_dir / 'calibration.json'}: {n} records "
            f"({', '.join(cal['layers'])}), attention {cal['attention']}")  # fmt: skip
    else:
        row("MFU benchmark", "FAIL", "no bench.json", "bench")
    summary_path = out_dir / "train" / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        losses = [s.get("first_mean_loss"), s.get("last_mean_loss")]
        if s.get("steps") and all(isinstance(x, float) and math.isfinite(x) for x in losses):
            detail = (f"{s['steps']} steps, loss {losses[0]:.3f} -> {losses[1]:.3f} (window {s['window']}), "
                      f"{s['tokens_per_s']:.0f} tokens/s, checkpoints {s['checkpoints']}")  # fmt: skip
            row("trainer, pp=1, 1 process, bf16", "PASS", detail, "train")
        else:
            row("trainer, pp=1, 1 process, bf16", "FAIL", f"{s.get('steps')} steps, losses {losses}", "train")
    else:
        row("trainer, pp=1, 1 process, bf16", "FAIL", f"no {summary_path}", "train")
    total = sum(s for _, s in status.values())
    head = ["| check | result | detail |", "|---|---|---|"]
    table = "\n".join([*head, *rows, f"| total | {'PASS' if ok else 'FAIL'} | {total:.0f} s |"])
    return table, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    table, ok = report(args.out)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
