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


def test_agreement_records_round_trip_values_and_errors():
    """What one rank sends in an agreement is what its peers read: ints, short strings, its error."""
    from distca.mesh import _SLOT, _TEXT, _decode, _ranks, _record

    fields = {"plan": "0a1b2c3d4e5f607", "T (q rows)": 8192, "Hq": -1, "dtype": "bfloat16", "mode": ""}
    rec = _record("q has T=12 rows ✓", fields)
    assert len(rec) == 8 + _SLOT * len(fields) + _TEXT == len(_record(None, fields))
    assert _decode(rec, list(fields)) == (True, fields, "q has T=12 rows ✓")
    assert _decode(_record(None, fields), list(fields)) == (False, fields, "")
    long = _decode(_record("x" * 1000, {"s": "y" * 100}), ["s"])
    assert long[1]["s"] == "y" * (_SLOT - 1) and long[2] == "x" * _TEXT  # truncated, never overflowing
    assert _ranks([3]) == "rank 3" and _ranks([0, 1, 2]) == "ranks 0, 1, 2"
    assert _ranks(list(range(20))) == "ranks 0, 1, 2, 3, 4, 5, 6, 7, ... (20 ranks)"
