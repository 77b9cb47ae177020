"""core_attention on real gloo process groups (2 and 4 ranks) against a single-process reference."""

import numpy as np
import pytest
import torch

from dist_utils import run_workers
from test_dispatch import ref_attention

POLICIES = ("distca", "greedy", "per_doc_cp", "colocated")


def _reference(cu, q, k, v, dout):
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out = ref_attention(q64, k64, v64, cu)
    (out * dout.double()).sum().backward()
    return out.detach(), q64.grad, k64.grad, v64.grad


def _exactness_worker(rank, world, cases):
    import distca

    worst = 0.0
    for cu, T, hq, hkv, d, policy, mode, dtype in cases:
        g = torch.Generator().manual_seed(len(cu) * 7919 + T)
        N = world * T
        q = torch.randn(N, hq, d, generator=g)
        k = torch.randn(N, hkv, d, generator=g)
        v = torch.randn(N, hkv, d, generator=g)
        dout = torch.randn(N, hq, d, generator=g)
        ref = _reference(cu, q, k, v, dout)
        sl = slice(rank * T, (rank + 1) * T)
        ql, kl, vl = (x[sl].to(dtype).requires_grad_() for x in (q, k, v))
        p = distca.plan(distca.Layout(tuple(cu), world, T), policy, min_shard=8)
        dp = distca.prepare(p)
        out = distca.core_attention(ql, kl, vl, torch.tensor(cu), plan=dp, mode=mode)
        (out * dout[sl].to(dtype)).sum().backward()
        tol = 1e-5 if dtype == torch.float32 else 4e-2
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref):
            err = (got.double() - want[sl]).abs().max().item()
            worst = max(worst, err)
            assert err <= tol * (1 + want[sl].abs().max().item()), (
                f"{name} error {err:.2e} > tol for cu={cu[:6]}..., T={T}, policy={policy}, mode={mode}, {dtype}"
            )
    return worst


def _cases(world, rng):
    T = 97  # not a multiple of anything
    N = world * T
    layouts = [
        [0, N],  # one document covering the whole stream
        [0, 1, 2, 3, N - 1, N],  # length-1 documents
        [0, T // 2, T + T // 3, 2 * T + 5 if world > 2 else N - 7, N],  # documents spanning ranks
        sorted({0, N, *rng.choice(np.arange(1, N), size=N // 6, replace=False).tolist()}),  # many tiny docs
    ]
    cases = []
    for i, cu in enumerate(layouts):
        for j, policy in enumerate(POLICIES):
            mode = "resend" if (i + j) % 2 == 0 else "keep"
            hq, hkv = [(4, 2), (4, 4), (4, 1)][(i + j) % 3]
            cases.append((cu, T, hq, hkv, 16, policy, mode, torch.float32))
    cases.append((layouts[2], T, 4, 2, 16, "distca", "resend", torch.bfloat16))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_exact_against_single_process(world):
    rng = np.random.default_rng(world)
    worst = run_workers(_exactness_worker, world, _cases(world, rng))
    assert max(worst) < 4e-2
