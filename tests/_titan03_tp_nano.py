"""torchtitan 0.3's llama3 with CAD, tensor parallelism and two nano-batches, in one gloo worker.

dp_shard 2 x tp 2 on 4 processes (torchtitan 0.3's ``ParallelDims`` with the registry's
``partial_dtensor`` backend; CA groups {0, 2} and {1, 3}, TP groups {0, 1} and {2, 3}), the
debug model cut to 2 layers (dim 256, 16 heads: 8 per TP rank), converted by
:func:`torchtitan_ext.titan03.model.convert` (``CANanoBlock``) and parallelized by torchtitan's own
``Module.parallelize`` with llama3's sequence-parallel sharding configs. One window of R * T = 2 * 64
tokens whose document [20, 100) crosses both CA ranks' boundary and the nano-batch split; each
rank's row comes from the loader's own ``torchtitan_ext.data.nano_rank_batch`` (TP-major rows).
The 0.3 counterpart of ``tests/_tp_nano.py``; used by ``tests/test_titan03_3d.py``.
"""

from __future__ import annotations

from torchtitan_ext.titan03 import _compat

_compat.apply()  # before any torchtitan import in a spawned worker

import torch  # noqa: E402

R, T, TP = 2, 64, 2
"""CA ranks (batch ranks), tokens per rank, tensor-parallel degree."""
CU = [0, 20, 100, 107, 128]
"""The window's documents: [20, 100) crosses the rank boundaries (32, 96) and the nano-batch split (64)."""
LAYERS = 2


def _model_config(*, converted: bool):
    """The debug model's config cut to ``LAYERS`` layers; with ``converted`` as CAD with ping-pong
    converts it (CANanoBlock; "sequential" runs the same blocks with a StepPlan without ping-pong)."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.titan03.model import convert, set_rope_span

    cfg = model_registry("debugmodel", attn_backend="varlen").model
    cfg.layers = cfg.layers[:LAYERS]
    if converted:
        convert(cfg, CoreAttention(enable=True, degree=R, pingpong=True))
        set_rope_span(cfg, R)
    set_llama3_sharding_config(cfg, enable_sp=True)  # what update_from_config does with TP (SP on)
    return cfg


def _window():
    from torchtitan_ext.data import GroupWindow, StreamState

    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 2048, (R * T,), generator=g)
    cu = torch.tensor(CU)
    starts = torch.repeat_interleave(cu[:-1], cu.diff())
    positions = torch.arange(R * T) - starts
    return GroupWindow(tokens, torch.zeros_like(tokens), positions, cu, StreamState())


def _reference(params: dict, window, weights):
    """fp64 logits [R * T, V] of the unconverted model over the whole window in one process
    (block-causal SDPA per document, tests/titan03_reference_train.py's attention), and its
    parameter gradients of ``sum(logits * weights)``."""
    from titan03_reference_train import BlockCausalSDPA, block_causal_mask

    cfg = _model_config(converted=False)
    for layer in cfg.layers:
        layer.attention.inner_attention = BlockCausalSDPA.Config()
    ref = cfg.build()
    with torch.no_grad():
        ref.init_weights(buffer_device=None)
    missing = set(dict(ref.named_parameters())) ^ set(params)
    assert not missing, missing
    ref.load_state_dict(params, strict=False)
    ref.double()  # the RoPE cache (complex64) stays as it is
    mask = block_causal_mask(torch.tensor(CU), R * T)
    logits = ref(window.tokens[None], positions=window.positions[None], attention_masks=mask)[0]  # [R * T, V]
    (logits * weights.double()).sum().backward()
    return logits.detach(), {n: p.grad.detach() for n, p in ref.named_parameters()}


def worker(rank: int, world: int, runs: tuple[str, ...], record: bool = False) -> dict:
    """Run the converted TP model once per entry of ``runs``: ``"pingpong"``, ``"sequential"``
    (``nano_batches = 2`` without ping-pong: the same plans one after the other), and two
    deliberately wrong variants: ``"no_tp_order"`` (ping-pong on rows a loader without the
    TP-major order gives) and ``"uncut_positions"`` (the block cuts positions as without TP).
    Returns per run: this rank's logits error against the fp64 reference (rows un-permuted by the
    loader's index), the scale (max |reference|), the parameter gradients' (``full_tensor()`` over
    TP, summed over the batch ranks) worst error relative to each reference gradient's max, and
    the logits and gradients (numpy) for the bit comparison; with ``record``, the collectives each
    run issued in its forward and backward (``dist_utils.count_collectives(functional=True)``: DTensor's
    redistributions too), with this rank's TP and CA groups."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.parallel_dims import ParallelDims

    import distca
    from dist_utils import count_collectives
    from distca.cost import ModelShape, load_cost_model
    from torchtitan_ext import data
    from torchtitan_ext.ca_mesh import build_ca_mesh
    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.planning import CAPlanner, StepPlan
    from torchtitan_ext.titan03.model import CANanoBlock

    pd = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=TP, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    pd.build_mesh()
    cfg = _model_config(converted=True)
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # every rank the same weights
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.parallelize(pd)  # torchtitan's TP: the declared shardings, sequence parallel
    blocks = list(model.layers.values())
    assert all(type(b) is CANanoBlock and b._ca_tp == TP for b in blocks)

    window = _window()
    weights = torch.randn(R * T, 2048, generator=torch.Generator().manual_seed(3))  # d loss / d logits
    ref_logits, ref_grads = _reference(params, window, weights)
    index = window._replace(tokens=torch.arange(R * T))  # its "input" is each row's stream index

    mesh = build_ca_mesh(pd, R)
    attn = cfg.layers[0].attention
    ca = CoreAttention(enable=True, degree=R, pingpong=True, min_shard=4)
    pl = CAPlanner(
        cfg=ca, mesh=mesh, degree=R, rank=mesh.get_local_rank("ca"), nano_batches=2, microbatches=1,
        shape=ModelShape(attn.n_heads // TP, (attn.n_kv_heads or attn.n_heads) // TP, cfg.dim // attn.n_heads, 4),
        cost_model=load_cost_model("h200"),
    )  # fmt: skip
    pl.spec = distca.CallSpec(pl.shape.num_heads, pl.shape.num_kv_heads, pl.shape.head_dim, torch.float32, "resend")
    b = pd.get_mesh("batch").get_local_rank()
    out = {
        "tp_group": tuple(dist.get_process_group_ranks(pd.get_mesh("tp").get_group())),
        "ca_group": tuple(dist.get_process_group_ranks(pl.group)),
    }
    for run in runs:
        tp_rows = 1 if run == "no_tp_order" else TP
        item, _ = data.nano_rank_batch(window, b, T, tp_rows)
        rows = data.nano_rank_batch(index, b, T, tp_rows)[0]["input"][0]  # [T] stream index of each row
        cus, ctxs = data.pop_layout(dict(item))
        step = pl.bind(pl.plan(cus, ctxs))  # agreed now (spec given): no collective of its own in the layers
        if run == "sequential":
            step = StepPlan(step.plans, step.stats, step.mode, pingpong=False)
        for blk in blocks:
            blk._ca_tp = 1 if run == "uncut_positions" else TP
        model.zero_grad(set_to_none=True)
        with count_collectives(functional=True) as calls:
            logits = model(item["input"], positions=item["positions"], attention_masks=step)
            logits = (logits.full_tensor() if isinstance(logits, DTensor) else logits)[0]  # [T, V]
            (logits * weights[rows]).sum().backward()
        distca.check(step.plans)
        grads = {}
        for name, p in model.named_parameters():
            g = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            dist.all_reduce(g, group=pd.get_mesh("batch").get_group())  # the window's gradient: both batch ranks
            grads[name] = g
        err = (logits.double() - ref_logits[rows]).abs().max().item()
        grad_err = {n: ((g.double() - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item() for n, g in grads.items()}
        out[run] = {
            "logits_err": err, "logits_scale": ref_logits[rows].abs().max().item(), "grad_err": grad_err,
            "logits": logits.detach().numpy(), "grads": {n: g.numpy() for n, g in grads.items()},
            "moved": [p.plan.traffic.total_bytes > 0 for p in step.plans], "calls": list(calls) if record else None,
        }  # fmt: skip
    for blk in blocks:
        blk._ca_tp = TP
    return out
