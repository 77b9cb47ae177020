"""The CA group: resolving it from a ProcessGroup or DeviceMesh, and agreeing across it.

An *agreement* is one small collective in which every rank of the group sends a
fixed-size record (an error flag, named values, an error message) and raises
``ValueError`` if any rank had an error or any value differs. The runtime agrees
once per plan (when it is prepared, or at its first call) and once per step
(:func:`distca.check`), never per layer call (``docs/guides/core_attention.md``,
"Errors"). Every record has the same size whatever its fields, so
whatever agreement a peer is in, a rank that rejects its input pairs with it
(and its error reaches the peer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["resolve_group", "agree"]

CA_DIM = "ca"

CARRIED = (
    "Its calls ran with zero placeholder rows so that no rank waited: the step's results are not "
    "valid, discard it (do not apply its gradients)."
)
"""How a message ends when the error was a carried call's (one that already ran on placeholders)."""


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


def _collective_device(pg: dist.ProcessGroup) -> torch.device:
    """Where the group's agreement runs: the CPU when any of its backends takes CPU tensors
    (gloo, e.g. ``init_process_group("cuda:nccl,cpu:gloo")``: a host-only collective, no
    device synchronisation), else the group's bound device (``device_id`` at init), else the
    current CUDA device (an NCCL-only group cannot take CPU tensors; reading the result back
    synchronises the host with that device once per agreement).

    Reads the group's registered device types, not ``get_backend(pg)``: that reads
    'undefined' for groups a DeviceMesh created.
    """
    types = {torch.device(d).type for d in getattr(pg, "_device_types", ())}
    if not types or "cpu" in types:
        return torch.device("cpu")
    bound = getattr(pg, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    if "cuda" in types and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_SLOT = 24
"""Bytes of one field in an agreement record: an int64, or a short string (utf-8, truncated)."""
_FIELDS = 10
"""Field slots in every record (unused ones empty), so any two agreements pair up byte for byte."""
_TEXT = 320
"""Bytes of a rank's error message in its record (utf-8, truncated)."""


def _record(local_error: str | None, fields: dict[str, int | str], carried: bool = False) -> bytes:
    if len(fields) > _FIELDS:
        raise ValueError(f"an agreement carries at most {_FIELDS} fields, got {len(fields)}")
    out = bytearray(8 + _SLOT * _FIELDS + _TEXT)
    out[0] = (2 if carried else 1) if local_error else 0
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
    out[8 + _SLOT * _FIELDS : 8 + _SLOT * _FIELDS + len(text)] = text
    return bytes(out)


def _decode(rec: bytes, names: list[str]) -> tuple[int, dict[str, int | str], str]:
    vals: dict[str, int | str] = {}
    for i, name in enumerate(names):
        slot = 8 + _SLOT * i
        if rec[slot] == 2:
            vals[name] = rec[slot + 1 : slot + _SLOT].rstrip(b"\0").decode(errors="replace")
        else:
            vals[name] = int.from_bytes(rec[slot + 8 : slot + 16], "little", signed=True)
    text = rec[8 + _SLOT * _FIELDS :].rstrip(b"\0").decode(errors="replace")
    return rec[0], vals, text


def _ranks(rs: list[int]) -> str:
    shown = ", ".join(map(str, rs[:8])) + (f", ... ({len(rs)} ranks)" if len(rs) > 8 else "")
    return f"rank{'s' if len(rs) > 1 else ''} {shown}"


def agree(
    pg: dist.ProcessGroup | None,
    local_error: str | None,
    fields: dict[str, int | str],
    consequence: str = "Nothing was sent.",
    carried: bool = False,
) -> None:
    """Raise ``ValueError`` on every rank of ``pg`` if any rank has ``local_error`` or any of
    ``fields`` differs across the ranks.

    One all-to-all (an all-gather) of a fixed-size record per rank: an error flag, the fields
    (named ints or short strings; every rank passes the same names in the same order) and the
    rank's error message, so every rank can say which rank failed and why, and which values
    differ on which ranks. A rank with an error still takes part, so its peers raise too.
    ``consequence`` ends the peers' message (what the failed call left behind); ``carried``: this
    rank's error is a carried call's, so every rank's message ends with :data:`CARRIED` instead.
    """
    if pg is None or dist.get_world_size(pg) == 1:  # no group (a process-local plan) or a group of 1
        if local_error:
            raise ValueError(local_error)
        return
    R, me = dist.get_world_size(pg), dist.get_rank(pg)
    rec = _record(local_error, fields, carried)
    dev = _collective_device(pg)
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
        if any(got[f][0] == 2 for f in failed):
            consequence = CARRIED
        more = f" (and {_ranks(failed[1:])})" if len(failed) > 1 else ""
        raise ValueError(
            f"another rank of the CA group (size {R}) rejected its input: rank {r}{more} says: {got[r][2]!r}. {consequence}"
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
            + consequence
        )
