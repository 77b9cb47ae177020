"""Core attention in a research model: DTensors on a "ca" mesh, FSDP2, one plan per step.

    torchrun --nproc_per_node 2 examples/core_attention_dtensor_fsdp.py

Every rank holds T consecutive tokens of one packed stream; documents of uneven lengths cross
the rank boundaries. ``distca.prepare`` plans once per step which rank computes which part of
each document's causal attention; ``distca.core_attention`` runs it on DTensors sharded
``Shard(0)`` over the mesh's "ca" dim. Runs on CUDA/NCCL when GPUs are there, else CPU/gloo.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import distca

T, DIM, HQ, HKV, STEPS = 256, 64, 4, 2, 4  # tokens per rank, model width, query / K/V heads, steps


class Attention(nn.Module):
    """One attention layer with a residual: x [T, DIM] -> [T, DIM], this rank's tokens."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, HQ, D], k and v [T, HKV, D]."""
        n = x.shape[0]
        return (
            self.wq(x).view(n, self.heads, self.head_dim),
            self.wk(x).view(n, self.kv_heads, self.head_dim),
            self.wv(x).view(n, self.kv_heads, self.head_dim),
        )

    def forward(self, x: torch.Tensor, plan: distca.DispatchPlan | torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        # The local rows are this rank's shard of the global stream: Shard(0) on "ca".
        q, k, v = (DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in self.qkv(x))
        out = distca.core_attention(q, k, v, None, plan=plan)  # a DTensor, Shard(0)
        return x + self.wo(out.to_local().flatten(1))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Causal attention per document on the whole stream, in one process (fp64 SDPA).
    q [R*T, HQ, D], k and v [R*T, HKV, D] -> [R*T, HQ, D]."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [heads, R*T, D]
    outs = [
        F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, enable_gqa=True)
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])
    ]
    return torch.cat(outs, dim=1).transpose(0, 1)


def documents(step: int, total: int) -> list[int]:
    """cu_seqlens of a step: 0, ..., total, documents of 20 to 300 tokens (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + int(torch.randint(20, 300, (1,), generator=g))))
    return cu


def init() -> tuple[torch.device, DeviceMesh, torch.dtype]:
    """The process group, a 1-D "ca" mesh over every rank, and the device and dtype to run in."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # gloo beside NCCL runs distca's small agreements on the host, without a device sync.
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ca",))
    return device, mesh, torch.bfloat16 if cuda else torch.float32  # CUDA flash kernels take 16-bit inputs


def main() -> None:
    device, mesh, dtype = init()
    rank, R = mesh.get_local_rank(), mesh.size()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Attention(DIM, HQ, HKV).to(device)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(R * T, DIM, device=device)[rank * T : (rank + 1) * T]  # this rank's tokens
    target = torch.randn(R * T, DIM, device=device)[rank * T : (rank + 1) * T]

    for step in range(STEPS):
        cu_seqlens = documents(step, R * T)
        plan = distca.prepare(cu_seqlens, group=mesh)  # every rank, once per step
        if step == 0:  # the op against one process's per-document attention on the whole stream
            with torch.no_grad():
                model.unshard()  # whole weights outside the FSDP forward
                q, k, v = model.qkv(x.to(dtype))
                model.reshard()
                q, k, v = (DTensor.from_local(t, mesh, [Shard(0)]) for t in (q, k, v))
                out = distca.core_attention(q, k, v, None, plan=plan)
                ref = reference(q.full_tensor(), k.full_tensor(), v.full_tensor(), cu_seqlens)
                err = (out.full_tensor().double() - ref).abs().max().item()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            if rank == 0:
                print(f"max |core_attention - reference| = {err:.2e} (tolerance {tol:.0e})")
            assert err < tol, err
        y = model(x, plan, mesh)  # FSDP gathers the weights (in dtype) for the forward
        loss = F.mse_loss(y.float(), target)
        loss.backward()
        distca.check(plan)  # after the backward, before the optimizer: a bad call raises on every rank
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean over ranks, for the print
        if rank == 0:
            docs, imbalance = len(cu_seqlens) - 1, plan.plan.imbalance
            print(f"step {step}: {docs} documents, imbalance {imbalance:.3f}, loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
