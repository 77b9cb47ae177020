"""A converted llama3 under torchtitan's tensor parallelism with two nano-batches, in one gloo worker.

dp_shard 2 x tp 2 on 4 processes (torchtitan's ``ParallelDims``; CA groups {0, 2} and {1, 3}, TP
groups {0, 1} and {2, 3}), a 2-layer llama3 (dim 64, 4 query / 2 KV heads: 2 / 1 per TP rank) with
the ``core_attention`` converter and torchtitan's ``apply_tp``, and one window of R * T = 2 * 64
tokens whose document [20, 100) crosses both CA ranks' boundary (32 in nano-batch 0, 96 in
nano-batch 1) and the nano-batch split (64). Each rank's row comes from the loader's own
``torchtitan_ext.data.nano_rank_batch`` (TP-major rows). Used by ``tests/test_tensor_parallel.py``
(exactness) and ``tests/test_per_layer.py`` (the collectives' order).
"""

from __future__ import annotations

import dataclasses

import torch

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in a spawned worker

R, T, TP = 2, 64, 2
"""CA ranks (batch ranks), tokens per rank, tensor-parallel degree."""
CU = [0, 20, 100, 107, 128]
"""The window's documents: [20, 100) crosses the rank boundaries (32, 96) and the nano-batch split (64)."""
VOCAB = 128


def _args():
    from torchtitan.protocols import train_spec as ts

    base = ts.get_train_spec("llama3").model_args["debugmodel"]
    return dataclasses.replace(base, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB)


class DocumentAttention(torch.nn.Module):
    """The reference's inner attention: torchtitan's SDPA wrapper's call, (1, H, L, D) in and out,
    per-document causal attention over the window (``tests/_reference.attention``, q's dtype)."""

    def __init__(self, cu: list[int]) -> None:
        super().__init__()
        self.cu = cu

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        from _reference import attention

        out = attention(*(x[0].transpose(0, 1) for x in (q, k, v)), self.cu)  # [L, Hq, D]
        return out.transpose(0, 1)[None]


def _window():
    from torchtitan_ext.data import GroupWindow, StreamState

    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (R * T,), generator=g)
    cu = torch.tensor(CU)
    starts = torch.repeat_interleave(cu[:-1], cu.diff())
    positions = torch.arange(R * T) - starts
    return GroupWindow(tokens, torch.zeros_like(tokens), positions, cu, StreamState())


def _reference(state, args, window, weights):
    """fp64 logits [R * T, V] of the unconverted model over the whole window, and its parameter gradients
    of ``sum(logits * weights)``."""
    from torchtitan.models.llama3.model.model import Transformer

    ref = Transformer(args)
    ref.load_state_dict(state)
    ref.double()  # RoPE stays fp32 inside torchtitan's apply_rotary_emb
    for block in ref.layers.values():
        block.attention.inner_attention = DocumentAttention(CU)
    logits = ref(window.tokens[None], positions=window.positions[None])[0]  # [R * T, V]
    (logits * weights.double()).sum().backward()
    return logits.detach(), {n: p.grad.detach() for n, p in ref.named_parameters()}


def worker(rank: int, world: int, runs: tuple[str, ...], record: bool = False) -> dict:
    """Run the converted TP model once per entry of ``runs``: ``"pingpong"``, ``"sequential"``
    (``nano_batches = 2`` without ping-pong: the same plans, one nano-batch after the other),
    ``"no_tp_order"`` (ping-pong on the rows a loader without the TP-major order would give: the
    deliberately wrong variant), or ``"whole"`` alone (a model converted without nano-batches, each
    rank's T rows in one plan). Returns per run: this rank's logits error against the fp64 reference
    (rows un-permuted), the scale (max |reference|), the parameter gradients' (summed over the batch
    ranks, ``full_tensor()`` over TP) worst error relative to each reference gradient's max, the
    logits and gradients themselves (numpy: torch tensors would travel through shared memory); with ``record``, the collectives each run issued
    (``dist_utils.count_collectives(functional=True)``) with this rank's TP and CA groups."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import apply_tp
    from torchtitan.models.llama3.model.model import Transformer

    import distca
    from _titan import ROOT
    from dist_utils import count_collectives
    from torchtitan_ext import data
    from torchtitan_ext.converter import CoreAttentionConverter
    from torchtitan_ext.planning import StepPlan

    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=TP, pp=1, ep=1, etp=1, world_size=world)
    pd.build_mesh()
    batch, tp_mesh = pd.get_mesh("batch"), pd.get_mesh("tp")
    nano = runs != ("whole",)
    if nano and "whole" in runs:
        raise ValueError(f'"whole" runs alone (another model), got {runs}')
    job = ConfigManager().parse_args([
        "--job.config_file", str(ROOT / "train_configs/debug_cpu.toml"), "--training.dataset", "synthetic_pretrain",
        "--training.seq_len", str(T), "--parallelism.tensor_parallel_degree", str(TP), "--core_attention.degree",
        str(R), "--core_attention.min_shard", "4", "--model.hf_assets_path", str(data.TOKENIZER_PATH),
        *(["--core_attention.pingpong"] if nano else []),
    ])  # fmt: skip
    conv = CoreAttentionConverter(job, pd)
    args = _args()
    torch.manual_seed(0)
    model = Transformer(args)
    conv.convert(model)  # raises args.max_seq_len to R * T
    torch.manual_seed(1)
    with torch.no_grad():  # as torchtitan does it, on the meta-initialised model
        model.init_weights()  # every rank the same weights (and freqs_cis for the new max_seq_len)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False)

    window = _window()
    weights = torch.randn(R * T, VOCAB, generator=torch.Generator().manual_seed(3))  # d loss / d logits
    ref_logits, ref_grads = _reference(state, args, window, weights)
    index = window._replace(tokens=torch.arange(R * T))  # its "input" is each row's stream index

    b = batch.get_local_rank()
    pl = conv.planner
    pl.spec = distca.CallSpec(pl.shape.num_heads, pl.shape.num_kv_heads, pl.shape.head_dim, torch.float32, "resend")
    out = {"tp_group": tuple(dist.get_process_group_ranks(tp_mesh.get_group())),
           "ca_group": tuple(dist.get_process_group_ranks(pl.group))}  # fmt: skip
    for run in runs:
        tp_rows = TP if run != "no_tp_order" else 1
        cut = (lambda w: data.rank_batch(w, b, T)) if run == "whole" else (lambda w: data.nano_rank_batch(w, b, T, tp_rows))
        item, _ = cut(window)
        rows = cut(index)[0]["input"][0]  # [T] stream index of each row
        cus, ctxs = data.pop_layout(dict(item))
        step = pl.bind(pl.plan(cus, ctxs))  # agreed now (spec given): no collective of its own in the layers
        if run == "sequential":
            step = StepPlan(step.plans, step.stats, step.mode, pingpong=False)
        model.zero_grad(set_to_none=True)
        with count_collectives(functional=True) as calls:
            logits = model(item["input"], attention_masks=step, positions=item["positions"])[0]  # [T, V]
            (logits * weights[rows]).sum().backward()
        distca.check(step.plans)
        grads = {}
        for name, p in model.named_parameters():
            g = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            dist.all_reduce(g, group=batch.get_group())  # the window's gradient: both batch ranks' rows
            grads[name] = g
        err = (logits.double() - ref_logits[rows]).abs().max().item()
        grad_err = {n: ((g.double() - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item() for n, g in grads.items()}
        out[run] = {
            "logits_err": err, "logits_scale": ref_logits[rows].abs().max().item(), "grad_err": grad_err,
            "logits": logits.detach().numpy(), "grads": {n: g.numpy() for n, g in grads.items()}, "moved": [p.plan.traffic.total_bytes > 0 for p in step.plans],
            "calls": list(calls) if record else None,
        }  # fmt: skip
    return out
