"""Ping-pong: one nano-batch's core-attention exchange in flight while the other computes.

    torchrun --nproc_per_node 2 examples/pingpong.py

Each rank's T tokens are split into two nano-batches of T/2 (``distca.split_nano_batches``,
documents kept whole: a document cut by the split continues in nano-batch 1 with its first
part as context). One attention layer runs them interleaved with ``distca.pingpong``
(start / serve / finish), then once more with plain ``distca.core_attention``, one nano-batch
after the other: outputs and gradients are equal bit for bit.
"""

import torch
import torch.distributed as dist
from torch import nn

import distca
from distca import pingpong

T, DIM, HQ, HKV = 512, 64, 4, 2
D = DIM // HQ


class Layer(nn.Module):
    """x [T, DIM] -> [T, DIM]: projections, causal document attention, output projection, residual."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(DIM, (HQ + 2 * HKV) * D, bias=False)
        self.wo = nn.Linear(HQ * D, DIM, bias=False)

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, HQ, D], k and v [n, HKV, D]."""
        q, k, v = self.wqkv(x).split([HQ * D, HKV * D, HKV * D], dim=1)
        return q.view(-1, HQ, D), k.view(-1, HKV, D), v.view(-1, HKV, D)

    def post(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return x + self.wo(out.flatten(1))

    def forward(self, x: torch.Tensor, plans: tuple, continued: bool, interleave: bool) -> torch.Tensor:
        x0, x1 = x.chunk(2)
        q0, k0, v0 = self.pre(x0)
        if interleave:
            f0 = pingpong.start(q0, k0, v0, plan=plans[0])  # nano 0's Q/K/V rows leave (async)
        q1, k1, v1 = self.pre(x1)  # ... while nano 1's projections compute
        if continued:  # nano 1 continues a document of nano 0: its K/V rows come first
            k1, v1 = torch.cat([k0, k1]), torch.cat([v0, v1])
        if not interleave:
            y0 = self.post(x0, distca.core_attention(q0, k0, v0, None, plan=plans[0]))
            y1 = self.post(x1, distca.core_attention(q1, k1, v1, None, plan=plans[1]))
            return torch.cat([y0, y1])
        f1 = pingpong.start(q1, k1, v1, plan=plans[1], after=f0)
        pingpong.serve(f0)  # nano 0's tasks on this server, then its outputs go home (async)
        pingpong.serve(f1)  # ... while nano 1's tasks compute
        y0 = self.post(x0, pingpong.finish(f0))  # nano 1's outputs travel meanwhile
        y1 = self.post(x1, pingpong.finish(f1))
        return torch.cat([y0, y1])


def main() -> None:
    dist.init_process_group("gloo")
    rank, R = dist.get_rank(), dist.get_world_size()
    # Rank 0 holds one document of T tokens, the other ranks short ones: attention is skewed,
    # and the planner moves part of rank 0's document to the others.
    cu_seqlens = [0, T, *range(T + 100, R * T, 150), R * T]
    nano0, nano1 = distca.split_nano_batches(distca.Layout(cu_seqlens, R, T), order="rows")
    # Each nano-batch planned on its own; min_shard: smallest query shard the planner cuts (tiny here).
    plans = distca.prepare(nano0, min_shard=32), distca.prepare(nano1, min_shard=32)

    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(R * T, DIM)[rank * T : (rank + 1) * T]
    results = []
    for interleave in (True, False):
        layer.zero_grad()
        y = layer(x, plans, bool(nano1.context), interleave)
        y.square().mean().backward()
        results.append([y.detach(), *(p.grad.clone() for p in layer.parameters())])
    distca.check(plans)

    diff = torch.stack([(a - b).abs().max() for a, b in zip(*results)]).max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # over every rank's rows and gradients
    imb = [p.plan.imbalance for p in plans]
    moved = [not p.meta.local_only for p in plans]
    if rank == 0:
        print(f"max |pingpong - core_attention| = {diff.item()} over the outputs and the weights' gradients "
              f"(nano-batches: rows exchanged {moved}, imbalance {imb[0]:.3f}, {imb[1]:.3f})")  # fmt: skip
    assert diff.item() == 0.0, "ping-pong must equal core_attention bit for bit"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
