"""The CA group: resolving it from a ProcessGroup or DeviceMesh, and agreeing across it.

Every check that can fail on one rank only is turned into a collective
agreement before any data moves, so a bad input raises on every rank of the
group instead of leaving the others waiting in an all-to-all. Every agreement
has the same record layout, so whatever agreement a peer is in, a rank that
rejects its input pairs with it (and its error reaches the peer).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["resolve_group", "agree"]

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


def _collective_device(pg: dist.ProcessGroup, preferred: torch.device) -> torch.device:
    """A device the group's backends can run the agreement on: ``preferred`` if supported, else CPU
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


_SLOT = 24
"""Bytes of one field in an agreement record: an int64, or a short string (utf-8, truncated)."""
_TEXT = 320
"""Bytes of a rank's error message in its record (utf-8, truncated)."""


def _record(local_error: str | None, fields: dict[str, int | str]) -> bytes:
    out = bytearray(8 + _SLOT * len(fields) + _TEXT)
    out[0] = 1 if local_error else 0
    for i, v in enumerate(fields.values()):
        slot = 8 + _SLOT * i
        if isinstance(v, str):
            b = v.encode()[: _SLOT - 1]
            out[slot] = 2
            out[slot + 1 : slot + 1 + len(b)] = b
        else:
            out[slot] = 1
            out[slot + 8 : slot + 16] = int(v).to_bytes(8, "little", signed=True)
    text = (local_error or "").encode()[:_TEXT]
    out[8 + _SLOT * len(fields) : 8 + _SLOT * len(fields) + len(text)] = text
    return bytes(out)


def _decode(rec: bytes, names: list[str]) -> tuple[bool, dict[str, int | str], str]:
    vals: dict[str, int | str] = {}
    for i, name in enumerate(names):
        slot = 8 + _SLOT * i
        if rec[slot] == 2:
            vals[name] = rec[slot + 1 : slot + _SLOT].rstrip(b"\0").decode(errors="replace")
        else:
            vals[name] = int.from_bytes(rec[slot + 8 : slot + 16], "little", signed=True)
    text = rec[8 + _SLOT * len(names) :].rstrip(b"\0").decode(errors="replace")
    return bool(rec[0]), vals, text


def _ranks(rs: list[int]) -> str:
    shown = ", ".join(map(str, rs[:8])) + (f", ... ({len(rs)} ranks)" if len(rs) > 8 else "")
    return f"rank{'s' if len(rs) > 1 else ''} {shown}"


def agree(
    pg: dist.ProcessGroup | None, device: torch.device, local_error: str | None, fields: dict[str, int | str]
) -> None:
    """Raise ``ValueError`` on every rank of ``pg`` if any rank has ``local_error`` or any of
    ``fields`` differs across the ranks.

    One all-to-all (an all-gather) of a fixed-size record per rank: an error flag, the fields
    (named ints or short strings; every rank passes the same names in the same order) and the
    rank's error message, so every rank can say which rank failed and why, and which values
    differ on which ranks. A rank with an error still takes part, so its peers raise too.
    """
    if pg is None or dist.get_world_size(pg) == 1:  # no group (a process-local plan) or a group of 1
        if local_error:
            raise ValueError(local_error)
        return
    R, me = dist.get_world_size(pg), dist.get_rank(pg)
    rec = _record(local_error, fields)
    dev = _collective_device(pg, device)
    send = torch.frombuffer(bytearray(rec * R), dtype=torch.uint8).to(dev)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    raw = recv.cpu().numpy().tobytes()
    names = list(fields)
    got = [_decode(raw[r * len(rec) : (r + 1) * len(rec)], names) for r in range(R)]
    if local_error:
        raise ValueError(local_error)
    failed = [r for r in range(R) if got[r][0]]
    if failed:
        r = failed[0]
        more = f" (and {_ranks(failed[1:])})" if len(failed) > 1 else ""
        raise ValueError(
            f"another rank of the CA group (size {R}) rejected its input: rank {r}{more} says: {got[r][2]!r}. Nothing was sent."
        )
    diffs = []
    for name in names:
        by_value: dict[int | str, list[int]] = {}
        for r in range(R):
            by_value.setdefault(got[r][1][name], []).append(r)
        if len(by_value) > 1:
            diffs.append(f"{name}: " + "; ".join(f"{v!r} on {_ranks(rs)}" for v, rs in by_value.items()))
    if diffs:
        raise ValueError(
            f"{', '.join(d.split(':')[0] for d in diffs)} {'differs' if len(diffs) == 1 else 'differ'} across the ranks "
            f"of the CA group (this is rank {me}): "
            + " | ".join(diffs)
            + ". Every rank must pass the same plan (cu_seqlens) and equal-shaped q, k, v with the same mode. "
            "Nothing was sent."
        )
