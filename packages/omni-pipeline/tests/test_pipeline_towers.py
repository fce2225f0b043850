"""Routing of a mixed image + audio encoder microbatch to the towers (``omni_pipeline.ModalityRouter``).

Reference (brute force): each sample run through its own tower alone, float64; the router's output must
equal those rows in the samples' order (<= 1e-12), whatever the interleaving of modalities, with one call
per tower; integer inputs reach the tower as built (not cast to the tower's dtype); gradients reach both
towers. And the errors: a sample without a tower, a builder whose rows do not match, mismatched keys.
"""

import pytest
import torch
from torch import nn

from omni_data import Modality, SampleMeta
from omni_data.payload import Payload
from omni_pipeline import ModalityRouter, TowerBatch

DIM = 6


class Tower(nn.Module):
    """``(features [rows, F], lengths int64 [n]) -> [rows, DIM]``; counts its calls."""

    def __init__(self, features: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter(torch.randn(features, DIM, generator=g, dtype=torch.float64))
        self.calls = 0

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        assert lengths.dtype == torch.int64 and int(lengths.sum()) == x.shape[0]
        self.calls += 1
        return torch.tanh(x @ self.proj)


def _inputs(features: int):
    def build(payloads):
        xs = [(p.pixels if p.pixels is not None else p.waveform).reshape(-1, features) for p in payloads]
        lengths = [x.shape[0] for x in xs]
        return TowerBatch((torch.cat(xs).float(), torch.tensor(lengths, dtype=torch.int64)), lengths)

    return build


def _payloads() -> list[Payload]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i, (mod, rows) in enumerate([("image", 2), ("audio", 3), ("audio", 1), ("image", 4), ("image", 1)]):
        modality = Modality(mod)
        meta = SampleMeta(f"s{i}", mod, modality, rows, 2, 1.0, (rows,))
        if modality is Modality.IMAGE:
            out.append(Payload(meta, pixels=torch.rand(rows, 4, generator=g)))
        else:
            out.append(Payload(meta, waveform=torch.rand(rows * 3, generator=g), sample_rate=16000))
    return out


def _router() -> ModalityRouter:
    towers = {"image": Tower(4, 1), "audio": Tower(3, 2)}
    return ModalityRouter(towers, {"image": _inputs(4), "audio": _inputs(3)}, DIM)


def test_mixed_microbatch_rows_come_back_in_sample_order():
    router = _router()
    payloads = _payloads()
    out = router(payloads)
    assert [t.calls for t in router.towers.values()] == [1, 1]  # each tower once, on its whole group
    want = []
    for p in payloads:
        name = str(p.meta.modality)
        x, lengths = router.inputs[name]([p]).args
        want.append(router.towers[name](x.double(), lengths))
    torch.testing.assert_close(out, torch.cat(want), rtol=0, atol=1e-12)
    out.sum().backward()
    assert all(t.proj.grad is not None and t.proj.grad.abs().sum() > 0 for t in router.towers.values())
    assert router([]).shape == (0, DIM)


def test_errors_name_what_is_wrong():
    image_only = ModalityRouter({"image": Tower(4, 1)}, {"image": _inputs(4)}, DIM)
    with pytest.raises(ValueError, match=r"sample audio/s1: no audio tower \(towers: \['image'\]\)"):
        image_only(_payloads())
    lying = ModalityRouter(
        {"image": Tower(4, 1)}, {"image": lambda ps: TowerBatch(_inputs(4)(ps).args, [1] * len(ps))}, DIM
    )
    with pytest.raises(ValueError, match="image tower: 2 output rows, its input builder says 1"):
        lying(_payloads()[:1])
    with pytest.raises(ValueError, match=r"differ in modalities \['audio'\]"):
        ModalityRouter({"image": Tower(4, 1)}, {"image": _inputs(4), "audio": _inputs(3)}, DIM)
