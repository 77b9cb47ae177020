"""distca.mesh: the device the agreement runs on, per group backend."""

from types import SimpleNamespace as NS

import pytest
import torch

from distca.mesh import _collective_device


@pytest.mark.parametrize(
    "types, preferred, want",
    [
        ([torch.device("cuda"), torch.device("cpu")], "cpu", "cpu"),  # gloo (+nccl): CPU is fine
        ([torch.device("cuda"), torch.device("cpu")], "cuda", "cuda"),
        ([torch.device("cpu")], "cuda", "cpu"),  # gloo only: never a CUDA tensor
        ([], "cpu", "cpu"),  # unknown backends: the caller's device
    ],
)
def test_collective_device_follows_the_groups_backends(types, preferred, want):
    assert _collective_device(NS(_device_types=types), torch.device(preferred)).type == want


def test_nccl_only_group_never_gets_a_cpu_tensor(monkeypatch):
    """torchtitan on GPUs makes NCCL-only groups: distca.prepare's CPU agreement must move to CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _collective_device(NS(_device_types=[torch.device("cuda")]), torch.device("cpu")) == torch.device("cuda", 3)
