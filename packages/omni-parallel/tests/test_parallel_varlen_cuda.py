"""The CUDA branch of ``varlen_attention`` (torch's fused ``varlen_attn``) against the reference kernel
(one SDPA per document, itself checked against attention written out from its definition in
``test_parallel_sequence.py``), outputs and gradients, in float64 on the CPU from the same rounded
inputs. Marked ``cuda``: skipped with the reason where no GPU is visible."""

import pytest
import torch

from omni_parallel.varlen import cu_seqlens_from_lengths, uses_device_kernel, varlen_attention

pytestmark = pytest.mark.cuda

LENGTHS = [1, 17, 0, 130, 64, 300]  # an empty document, a one-token one, lengths no block size divides


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_varlen_kernel_matches_the_reference_kernel(causal, dtype):
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = sum(LENGTHS), 8, 2, 64  # GQA 4:1
    base = [torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv)]
    grad_out = torch.randn(t, hq, d, generator=g)
    cu = cu_seqlens_from_lengths(LENGTHS)
    dev = torch.device("cuda")
    # q/k/v as the encoders make them: views of one fused projection (not contiguous over heads).
    fused = torch.cat([x.reshape(t, -1) for x in base], dim=1).to(dev, dtype).requires_grad_()
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    assert uses_device_kernel(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = varlen_attention(q, k, v, cu.to(dev), causal=causal)  # a CUDA cu_seqlens is accepted too
    assert any("varlen_attn" in e.name for e in prof.events()), "the fused kernel did not run"
    out.backward(grad_out.to(dev, dtype))

    ref_in = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref = varlen_attention(*ref_in, cu, causal=causal)
    ref.backward(grad_out.to(dtype).double())
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    assert (out.detach().cpu().double() - ref).abs().max() <= tol * ref.abs().max()
    grads = fused.grad.cpu().double().split([hq * d, hkv * d, hkv * d], dim=1)
    for name, got, want in zip("qkv", grads, (x.grad for x in ref_in)):
        want = want.reshape(t, -1)
        assert (got - want).abs().max() <= tol * want.abs().max(), name


def test_float32_on_cuda_runs_the_reference_kernel():
    q = torch.randn(40, 4, 32, device="cuda")
    assert not uses_device_kernel(q, q, q)
    cu = [0, 15, 40]
    got = varlen_attention(q, q, q, cu, causal=True)
    want = varlen_attention(q.cpu().double(), q.cpu().double(), q.cpu().double(), cu, causal=True)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
