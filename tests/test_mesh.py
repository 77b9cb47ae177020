"""distca.mesh: the device the agreement runs on, per group backend."""

from types import SimpleNamespace as NS

import pytest
import torch

from distca.mesh import _collective_device


@pytest.mark.parametrize(
    "types, want",
    [
        ([torch.device("cuda"), torch.device("cpu")], "cpu"),  # nccl + gloo: host-only, no device sync
        ([torch.device("cpu")], "cpu"),  # gloo only: never a CUDA tensor
        ([], "cpu"),  # unknown backends
    ],
)
def test_collective_device_prefers_a_host_backend(types, want):
    assert _collective_device(NS(_device_types=types, bound_device_id=None)).type == want


def test_nccl_only_group_runs_on_its_bound_device(monkeypatch):
    """torchtitan on GPUs makes NCCL-only groups: the agreement moves to CUDA, the group's bound
    device first (``init_process_group(device_id=...)``), else the current one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    nccl = [torch.device("cuda")]
    assert _collective_device(NS(_device_types=nccl, bound_device_id=None)) == torch.device("cuda", 3)
    assert _collective_device(NS(_device_types=nccl, bound_device_id=torch.device("cuda", 5))) == torch.device("cuda", 5)


def test_agreement_records_round_trip_values_and_errors():
    """What one rank sends in an agreement is what its peers read: ints, short strings, its error."""
    from distca.mesh import _FIELDS, _SLOT, _TEXT, _decode, _ranks, _record

    fields = {"plan": "0a1b2c3d4e5f607", "T (q rows)": 8192, "Hq": -1, "dtype": "bfloat16", "mode": ""}
    rec = _record("q has T=12 rows ✓", fields)
    # Every record has the same size whatever its fields, so any two agreements pair up.
    assert len(rec) == 8 + _SLOT * _FIELDS + _TEXT == len(_record(None, fields)) == len(_record(None, {"x": 1}))
    with pytest.raises(ValueError, match="at most 10 fields"):
        _record(None, {str(i): i for i in range(11)})
    assert _decode(rec, list(fields)) == (True, fields, "q has T=12 rows ✓")
    assert _decode(_record(None, fields), list(fields)) == (False, fields, "")
    long = _decode(_record("x" * 1000, {"s": "y" * 100}), ["s"])
    assert long[1]["s"] == "y" * (_SLOT - 1) and long[2] == "x" * _TEXT  # truncated, never overflowing
    assert _ranks([3]) == "rank 3" and _ranks([0, 1, 2]) == "ranks 0, 1, 2"
    assert _ranks(list(range(20))) == "ranks 0, 1, 2, 3, 4, 5, 6, 7, ... (20 ranks)"
