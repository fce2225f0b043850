"""Step 2 of ``benchmarks/gpu/check.sh``: a one-GPU MFU benchmark with per-layer calibration.

It times one LLM block (LLaMA-3-8B-like: dim 4096, 32 heads, 8 KV heads, SwiGLU 14336) and one
ViT block (Qwen2-VL-vision-like: dim 1280, 16 heads, MLP 5120, QuickGELU, 2-D RoPE), forward and
backward in bfloat16 over packs of documents with varlen attention (``omni_parallel.varlen``: torch's
fused ``varlen_attn`` on CUDA), and writes

* ``bench.json``: per model, the 8192-token pack's seconds, model TFLOP/s and MFU. FLOPs as the trainer
  counts them (``omni_parallel.flops``: 2 per multiply-add, backward = 2x forward, attention per document,
  halved when causal); MFU against the GPU's dense bf16 peak from :data:`PEAK_BF16` (matched on
  ``torch.cuda.get_device_name()``), and against the best bf16 matmul measured here (``mfu_measured``),
  which is the only peak there is on a CPU or an unknown GPU;
* ``calibration.json``: per-layer kernel times for the pipeline simulator's cost model, format
  ``omni-train-layer-times/1``::

      {"format": "omni-train-layer-times/1", "device": "NVIDIA H200", "dtype": "bfloat16",
       "torch": "2.15.0", "attention": "varlen_attn" | "reference",
       "layers": {"llm_block": {"config": {...}, "causal": true,
                                "records": [{"tokens": T, "tokens_sq": S, "docs": [L, ...],
                                             "forward_s": f, "backward_s": b}, ...]},
                  "vit_block": {...}}}

  ``tokens`` is a pack's length, ``tokens_sq`` the sum of its squared document lengths (the quadratic
  attention term; the same definition as ``TokenCost.per_token_sq_s`` of omni-pipeline's records and
  ``fit_cost_model``, on the ``planner`` branch, not merged into main when this was written), seconds are
  medians over timed repeats of ONE layer. A stage's action of ``n`` layers costs about ``n`` times a
  record; fitting ``base + a * tokens + b * tokens_sq`` per layer and kind (forward, backward) gives
  ``TokenCost`` coefficients.

``--smoke`` runs the same code on the CPU with tiny sizes (the test suite runs ``check.sh --smoke``).

    python benchmarks/gpu/bench.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from omni_parallel.flops import attention_flops, matmul_params
from omni_parallel.varlen import uses_device_kernel
from omni_train.models.attention import rope_angles
from omni_train.models.encoder_block import EncoderBlock
from omni_train.models.llm import Block, LLMConfig
from omni_train.models.vit import _patch_positions

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' datasheets. Matched in order on
# torch.cuda.get_device_name(): the more specific names first ("GH200" contains "H200", "H200" "H20").
PEAK_BF16 = (
    ("GH200", 989.4e12),
    ("H200 NVL", 835.0e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("H20", 148.0e12),
    ("GB200", 2500.0e12),
    ("B200", 2250.0e12),
    ("B100", 1750.0e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.0e12),
    ("L40", 181.0e12),
    ("L4", 121.0e12),
    ("RTX 4090", 165.2e12),
)
LLM_TARGET_MFU = 0.40


def peak_bf16(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU named ``device_name``, or None for an unknown one."""
    return next((peak for key, peak in PEAK_BF16 if key in device_name), None)


@dataclass(frozen=True)
class Sizes:
    """Benchmark sizes: the LLM and ViT blocks, the main pack and the calibration packs (tokens)."""

    llm: LLMConfig
    vit_dim: int
    vit_heads: int
    vit_image_side: int  # patches per side of each (square) image
    pack: int
    calibration_packs: tuple[int, ...]
    llm_doc: int  # document length in the LLM packs (the last document takes the remainder)
    repeats: int
    matmul_n: int


FULL = Sizes(
    llm=LLMConfig(vocab_size=1, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    vit_dim=1280,
    vit_heads=16,
    vit_image_side=32,
    pack=8192,
    calibration_packs=(1024, 2048, 4096, 8192),
    llm_doc=2048,
    repeats=10,
    matmul_n=8192,
)
SMOKE = Sizes(
    llm=LLMConfig(vocab_size=1, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    vit_dim=32,
    vit_heads=4,
    vit_image_side=4,
    pack=64,
    calibration_packs=(64,),
    llm_doc=24,
    repeats=2,
    matmul_n=128,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, cuBLAS/flash heuristics
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measured_matmul_peak(device: torch.device, n: int, repeats: int) -> float:
    """Best bf16 ``n x n`` matmul FLOP/s measured on ``device`` (``2 n^3`` FLOPs each)."""
    a = torch.full((n, n), 0.5, device=device, dtype=torch.bfloat16)
    b = torch.full((n, n), 0.25, device=device, dtype=torch.bfloat16)
    best = float("inf")
    torch.mm(a, b)
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _docs(tokens: int, doc: int) -> list[int]:
    return [doc] * (tokens // doc) + ([tokens % doc] if tokens % doc else [])


class _Layer:
    """One block, its inputs for a pack and its forward/backward as separately timed calls."""

    def __init__(self, kind: str, sizes: Sizes, device: torch.device, dtype: torch.dtype) -> None:
        self.kind, self.sizes, self.device, self.dtype = kind, sizes, device, dtype
        with torch.device(device):  # weights initialised on the device: seconds, not minutes, at 4096
            if kind == "llm_block":
                self.block = Block(sizes.llm).to(dtype)
                self.dim, self.causal = sizes.llm.dim, True
            else:
                self.block = EncoderBlock(sizes.vit_dim, sizes.vit_heads, norm_eps=1e-6, act="quick_gelu").to(
                    dtype
                )
                self.dim, self.causal = sizes.vit_dim, False

    def docs(self, tokens: int) -> list[int]:
        if self.kind == "llm_block":
            return _docs(tokens, self.sizes.llm_doc)
        return _docs(tokens, self.sizes.vit_image_side**2)  # images of side x side patches

    def inputs(self, docs: list[int]):
        t = sum(docs)
        cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()])  # on the host: no stream sync
        if self.kind == "llm_block":
            pos = torch.cat([torch.arange(n) for n in docs]).to(self.device)
            rope = rope_angles(pos, self.sizes.llm.head_dim, self.sizes.llm.rope_theta)
        else:
            side = self.sizes.vit_image_side
            grids = torch.tensor(
                [[1, side, side]] * (t // side**2) + ([[1, 1, t % side**2]] if t % side**2 else [])
            )
            rows, cols = (p.to(self.device) for p in _patch_positions(grids, 1))
            hd = self.dim // self.sizes.vit_heads
            (cr, sr), (cc, sc) = rope_angles(rows, hd // 2, 10000.0), rope_angles(cols, hd // 2, 10000.0)
            rope = (torch.cat([cr, cc], -1), torch.cat([sr, sc], -1))
        x = torch.randn(t, self.dim, device=self.device, dtype=self.dtype, requires_grad=True)
        return x, rope, cu

    def uses_device_kernel(self) -> bool:
        hd = self.dim // (self.sizes.llm.n_heads if self.kind == "llm_block" else self.sizes.vit_heads)
        q = torch.empty(1, 1, hd, device=self.device, dtype=self.dtype)
        return uses_device_kernel(q, q, q)

    def time(self, docs: list[int], repeats: int) -> tuple[float, float]:
        """Median seconds of one forward (building the autograd graph) and of one backward."""
        x, rope, cu = self.inputs(docs)
        grad = torch.randn_like(x)

        def forward():
            return self.block(x, rope, cu)  # the graph is freed when the result is dropped

        def forward_backward():
            self.block.zero_grad(set_to_none=True)
            x.grad = None
            self.block(x, rope, cu).backward(grad)

        fwd = _median_s(forward, self.device, repeats)
        both = _median_s(forward_backward, self.device, repeats)
        return fwd, max(0.0, both - fwd)

    def flops(self, docs: list[int]) -> float:
        """Training FLOPs of this layer over a pack (forward + backward = 3x forward)."""
        fwd = 2.0 * matmul_params(self.block) * sum(docs) + attention_flops(
            docs, self.dim, 1, causal=self.causal
        )
        return 3.0 * fwd


def bench(out_dir: Path, smoke: bool) -> dict:
    sizes = SMOKE if smoke else FULL
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16(name) if device.type == "cuda" else None
    measured = measured_matmul_peak(device, sizes.matmul_n, sizes.repeats)
    results, calibration = {}, {}
    for kind in ("llm_block", "vit_block"):
        layer = _Layer(kind, sizes, device, dtype)
        records = []
        for tokens in sizes.calibration_packs:
            docs = layer.docs(tokens)
            fwd, bwd = layer.time(docs, sizes.repeats)
            records.append({"tokens": tokens, "tokens_sq": sum(n * n for n in docs), "docs": docs,
                            "forward_s": fwd, "backward_s": bwd})  # fmt: skip
        docs = layer.docs(sizes.pack)
        main = next((r for r in records if r["tokens"] == sizes.pack), None)
        fwd, bwd = (main["forward_s"], main["backward_s"]) if main else layer.time(docs, sizes.repeats)
        flops_per_s = layer.flops(docs) / (fwd + bwd)
        config = asdict(sizes.llm) if kind == "llm_block" else {
            "dim": sizes.vit_dim, "n_heads": sizes.vit_heads, "mlp_ratio": 4, "act": "quick_gelu",
            "image_patches": sizes.vit_image_side**2}  # fmt: skip
        config.pop("n_layers", None)
        config.pop("vocab_size", None)
        results[kind] = {
            "config": config,
            "pack_tokens": sizes.pack,
            "docs": docs,
            "forward_s": fwd,
            "backward_s": bwd,
            "tflops": flops_per_s / 1e12,
            "mfu": flops_per_s / peak if peak else None,
            "mfu_measured": flops_per_s / measured,
            "fused_varlen": layer.uses_device_kernel(),
        }
        calibration[kind] = {"config": config, "causal": layer.causal, "records": records}
        del layer
    summary = {
        "device": name,
        "dtype": "bfloat16",
        "peak_bf16_flops": peak,
        "measured_matmul_flops": measured,
        "llm_target_mfu": LLM_TARGET_MFU,
        "smoke": smoke,
        "models": results,
    }
    attention = "varlen_attn" if all(r["fused_varlen"] for r in results.values()) else "reference"
    cal = {"format": "omni-train-layer-times/1", "device": name, "dtype": "bfloat16",
           "torch": torch.__version__, "attention": attention, "layers": calibration}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "calibration.json").write_text(json.dumps(cal, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = p.parse_args(argv)
    summary = bench(args.out, args.smoke)
    for kind, m in summary["models"].items():
        mfu = "n/a" if m["mfu"] is None else f"{m['mfu']:.1%}"
        print(f"{kind}: {m['tflops']:.2f} TFLOP/s, MFU {mfu}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
