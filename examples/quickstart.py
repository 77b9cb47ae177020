# torchrun --nproc_per_node 2 examples/quickstart.py
import torch
import torch.distributed as dist

import distca

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
T, Hq, Hkv, D = 256, 4, 2, 32  # tokens per rank, query heads, K/V heads, head dim

# Global document boundaries over all ranks' tokens, the same on every rank:
# the 300-token document crosses from rank 0 into rank 1.
cu_seqlens = [0, 50, 350, 400, world * T]

torch.manual_seed(rank)
q = torch.randn(T, Hq, D, requires_grad=True)  # this rank's rows [rank*T, (rank+1)*T)
k = torch.randn(T, Hkv, D, requires_grad=True)
v = torch.randn(T, Hkv, D, requires_grad=True)

plan = distca.prepare(cu_seqlens)  # once per step: balance attention over the ranks
out = distca.core_attention(q, k, v, None, plan=plan)  # [T, Hq, D], causal per document
out.square().mean().backward()
distca.check(plan)  # after the backward, before optimizer.step(): raises on every rank on bad input

print(f"rank {rank}: out {tuple(out.shape)}, |dq| {q.grad.norm():.4f}, imbalance {plan.plan.imbalance:.3f}")
dist.barrier()  # gloo: every rank done before teardown
dist.destroy_process_group()
