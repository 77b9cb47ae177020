"""The CA group: resolving it from a ProcessGroup or DeviceMesh, and agreeing across it.

Every check that can fail on one rank only is turned into a collective
agreement before any data moves, so a bad input raises on every rank of the
group instead of leaving the others waiting in an all-to-all.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["resolve_group", "agree", "fingerprint"]

CA_DIM = "ca"


def resolve_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    """The process group of the CA dimension.

    ``None``: the default group. A 1-D ``DeviceMesh``: its only dimension. An
    n-D ``DeviceMesh``: its ``"ca"`` dimension.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("core attention needs torch.distributed initialised (dist.init_process_group)")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        if group.ndim == 1:
            return group.get_group()
        if CA_DIM in names:
            return group.get_group(CA_DIM)
        raise ValueError(f"group is a {group.ndim}-D DeviceMesh with dims {names}; it needs a {CA_DIM!r} dimension")
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be None, a ProcessGroup or a DeviceMesh, got {type(group).__name__}")


def fingerprint(*parts: object) -> int:
    """A 62-bit hash of ints, strings and int arrays, equal on every rank for equal inputs."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, np.ndarray):
            h.update(np.ascontiguousarray(p, dtype=np.int64).tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little") >> 2


def _collective_device(pg: dist.ProcessGroup, preferred: torch.device) -> torch.device:
    """A device the group's backends can all-reduce on: ``preferred`` if supported, else CPU
    (gloo), else the current CUDA device (an NCCL-only group cannot take CPU tensors).

    Reads the group's registered device types, not ``get_backend(pg)``: that reads
    'undefined' for groups a DeviceMesh created.
    """
    types = {torch.device(d).type for d in getattr(pg, "_device_types", ())}
    if not types or preferred.type in types:
        return preferred
    if "cpu" in types:
        return torch.device("cpu")
    if "cuda" in types and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return preferred


def agree(
    pg: dist.ProcessGroup, device: torch.device, local_error: str | None, fields: dict[str, int]
) -> None:
    """Raise ``ValueError`` on every rank if any rank has ``local_error`` or ``fields`` differ.

    One all-reduce (MAX) of [error flag, fields, -fields]; ``fields`` are named
    ints that must be equal across the group (sizes, hashes).
    """
    vals = list(fields.values())
    dev = _collective_device(pg, device)
    t = torch.tensor([1 if local_error else 0, *vals, *(-v for v in vals)], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    t = t.tolist()
    n = len(vals)
    if local_error:
        raise ValueError(local_error)
    if t[0]:
        raise ValueError(
            f"another rank of the CA group (size {dist.get_world_size(pg)}) rejected its input; see its error. "
            "Nothing was sent."
        )
    bad = [name for i, name in enumerate(fields) if t[1 + i] != vals[i] or -t[1 + n + i] != vals[i]]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} differ across the ranks of the CA group (rank {dist.get_rank(pg)} has "
            f"{', '.join(f'{b}={fields[b]}' for b in bad)}); every rank must pass the same cu_seqlens "
            "and equal-shaped q, k, v. Nothing was sent."
        )
