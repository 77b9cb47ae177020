"""The model of ``core_attention_dtensor_fsdp.py`` under ``torch.compile``: a new plan every step,
compiled once.

    torchrun --nproc_per_node 2 examples/core_attention_compile.py

Every step has other document lengths and so another plan. The compiled graph takes the plan's
``handle`` (an int64 tensor of one element) as an input, so a new plan is new data, not a new
graph: after the first step the number of compiled graphs stays the same.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import distca
from core_attention_dtensor_fsdp import DIM, HKV, HQ, T, Attention, documents, init  # the same model, same data

STEPS = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager compiles faster)")
    args = ap.parse_args()
    device, mesh, dtype = init()
    rank, R = mesh.get_local_rank(), mesh.size()

    torch.manual_seed(0)
    model = Attention(DIM, HQ, HKV).to(device)
    model.compile(backend=args.backend, fullgraph=True)  # compile first, then shard (as torchtitan does)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(R * T, DIM, device=device)[rank * T : (rank + 1) * T]
    target = torch.randn(R * T, DIM, device=device)[rank * T : (rank + 1) * T]

    graphs_after_first = 0
    for step in range(STEPS):
        cu_seqlens = documents(step, R * T)
        plan = distca.prepare(cu_seqlens, group=mesh)
        y = model(x, plan.handle, mesh)  # the handle: a tensor input of the graph, not a constant
        loss = F.mse_loss(y.float(), target)
        loss.backward()
        distca.check(plan)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean over ranks, for the print
        if rank == 0:
            print(f"step {step}: {len(cu_seqlens) - 1} documents, loss {loss.item():.4f}")
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_first
    if rank == 0:
        print(f"graphs compiled in step 0: {graphs_after_first}, recompiles after it: {recompiles}")
    assert recompiles == 0, f"{recompiles} graphs compiled after the first step"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
