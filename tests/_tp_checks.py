"""The checks both torchtitan lanes make of TP with nano-batches (dp_shard 2 x tp 2, 4 gloo workers):
exactness against a one-process fp64 reference, and one collective order on every rank.

Each lane's worker (``tests/_tp_nano.py`` for 0.2.2, ``tests/_titan03_tp_nano.py`` for 0.3) returns
per rank ``{"tp_group", "ca_group", <case>: {...}}``; the cases and their fields are the workers'.
"""

from __future__ import annotations

import numpy as np

LOGITS_TOL = 2e-5
"""Max |logits - reference| over max(1, max |reference|), fp32 model against the fp64 one."""
GRAD_TOL = 1e-4
"""Max |grad - reference| over max |reference grad|, per parameter (sums over 128 rows, fp32)."""


def assert_exact(res: list[dict], n_params: int, wrong: dict[str, tuple[float, float | None]]) -> None:
    """Ping-pong within the tolerances of the fp64 reference on every rank, every parameter's gradient
    checked (``n_params`` of them), both nano-batches moving rows, and bit-equal to the sequential
    nano-batches. ``wrong``: negative controls, case -> (factor, factor or None): that case's logits
    (and gradients) miss the reference by more than factor x the tolerance."""
    for rank, r in enumerate(res):
        assert r["tp_group"] == (rank - rank % 2, rank - rank % 2 + 1) and r["ca_group"] == (rank % 2, rank % 2 + 2)
        pp, seq = r["pingpong"], r["sequential"]
        assert pp["moved"] == [True, True], pp["moved"]  # both nano-batches exchange rows
        assert pp["logits_err"] <= LOGITS_TOL * max(1.0, pp["logits_scale"]), (rank, pp["logits_err"])
        worst = max(pp["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= GRAD_TOL, (rank, worst)
        assert len(pp["grad_err"]) == n_params, sorted(pp["grad_err"])
        # Ping-pong only reorders exchanges: bit-equal to the sequential nano-batches.
        assert np.array_equal(pp["logits"], seq["logits"]), abs(pp["logits"] - seq["logits"]).max()
        assert all(np.array_equal(pp["grads"][n], seq["grads"][n]) for n in pp["grads"]), rank
        for case, (f_logits, f_grads) in wrong.items():
            w = r[case]
            assert w["logits_err"] > f_logits * LOGITS_TOL * max(1.0, w["logits_scale"]), (rank, case, w["logits_err"])
            if f_grads is not None:
                assert max(w["grad_err"].values()) > f_grads * GRAD_TOL, (rank, case, max(w["grad_err"].values()))


def _named(calls, tp_group, ca_group) -> list[tuple]:
    """(group role "tp"/"ca", kind, backward, elements) per recorded call: a rank-independent name for
    each, so that the sequences of all four ranks can be compared."""
    role = {tuple(tp_group): "tp", tuple(ca_group): "ca"}
    kind = lambda name: "AG" if "gather" in name else "RS" if "scatter" in name else "A2A" if "all_to_all" in name else name  # noqa: E731
    out = []
    for c in calls:
        r = role.get(c.group, f"other{c.group}")
        out.append((r, kind(c.name), c.backward, c.numel if r == "tp" else None))
    return out


def one_order(res: list[dict], case: str) -> tuple[list[tuple], list[tuple]]:
    """The one sequence of collectives every rank issued in ``case``, split into forward and backward
    calls ``(role, kind, elements)``; fails unless all ranks issued the same one (so the TP and CA
    groups cannot deadlock) and only on the TP and CA groups."""
    seqs = [_named(r[case]["calls"], r["tp_group"], r["ca_group"]) for r in res]
    assert all(s == seqs[0] for s in seqs), [len(s) for s in seqs]
    assert {r for r, *_ in seqs[0]} == {"tp", "ca"}, sorted({r for r, *_ in seqs[0]})
    fwd = [(r, k, n) for r, k, b, n in seqs[0] if not b]
    bwd = [(r, k, n) for r, k, b, n in seqs[0] if b]
    return fwd, bwd


def block_orders(half: int) -> tuple[list[tuple], list[tuple]]:
    """One block's forward collectives with ping-pong and for one nano-batch without it, each
    nano-batch's TP collectives of ``half`` elements (its local shard [1, T / (2 tp), dim]) in its own
    compute phases: all-gather before attention, the dispatches (q, kv) and the returns, the
    reduce-scatter after ``wo``, the FFN's all-gather and ``w2``'s reduce-scatter."""
    ag, rs, a2a = ("tp", "AG", half), ("tp", "RS", 2 * half), ("ca", "A2A", None)
    pingpong = [ag, a2a, a2a, ag, a2a, a2a, a2a, a2a, rs, ag, rs, rs, ag, rs]
    sequential = [ag, a2a, a2a, a2a, rs, ag, rs]
    return pingpong, sequential
