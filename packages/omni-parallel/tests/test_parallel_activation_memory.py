"""``omni_parallel.activation_memory`` on plain modules.

Reference for the measurement: the autograd graph itself. After a forward, every tensor autograd holds
for backward is an attribute ``_saved_*`` of some node of the graph; their distinct storages (parameters
excluded) summed are what :class:`ActivationMemory` must report as the peak (nothing is freed before
backward). (The app's ``test_train_activation_memory.py`` checks the same on its LLM and encoders.)
"""

from __future__ import annotations

import torch
from parallel_blocks import blocks
from torch import nn

from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.testing import graph_saved_bytes

D = torch.float64


def test_peak_equals_what_the_autograd_graph_saved_and_is_released_by_backward():
    model = blocks()
    memory = ActivationMemory([model], torch.device("cpu"))
    x = torch.randn(9, 16, dtype=D, generator=torch.Generator().manual_seed(0))
    memory.start_step()
    with memory.track():
        loss = model(x).pow(2).sum()
        in_graph = graph_saved_bytes(loss, list(model.parameters()))
        peaks = memory.peaks()
        loss.backward()
    assert in_graph > 0 and peaks.activation_bytes == in_graph
    assert peaks.offloaded_bytes == 0 and peaks.allocated_bytes is None
    memory.start_step()  # everything saved was freed by backward: nothing is live any more
    assert memory.peaks().activation_bytes == 0

    # one storage saved three times (x * x saves x twice, a view of x once) counts once
    x = torch.randn(1000, dtype=D, requires_grad=True)
    memory.start_step()
    with memory.track():
        y = (x * x).sum() + x.view(10, 100).sin().sum()
    assert memory.peaks().activation_bytes == 8000 == graph_saved_bytes(y, [])


def test_parameters_are_never_counted():
    lin = nn.Linear(64, 64).double()
    memory = ActivationMemory([lin], torch.device("cpu"))
    x = torch.randn(3, 64, dtype=D, requires_grad=True)
    memory.start_step()
    with memory.track():
        y = lin(x)
    # addmm saves the input (for d weight) and the weight (for d input); only the input is an activation
    assert (
        memory.peaks().activation_bytes
        == x.untyped_storage().nbytes()
        == graph_saved_bytes(y, list(lin.parameters()))
    )
