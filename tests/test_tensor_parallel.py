"""CAD with torchtitan's tensor parallelism: config rules, the CA mesh, the loader, end to end.

torchtitan 0.2.2 lays the world out as ("pp", "batch", "cp", "tp"), TP innermost, and shards
``wq``/``wk``/``wv`` column-wise, so TP rank ``t`` runs attention on its local heads over the full
row. The CA group of a rank is then the ``degree`` consecutive batch ranks that hold the same TP
rank (``torchtitan_ext.ca_mesh.build_ca_mesh``); its TP peers read the same tokens.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in this process

from torchtitan_ext.config import CoreAttention, validate  # noqa: E402

from dist_utils import run_workers  # noqa: E402
from _titan import _STEPS, ROOT, _from_seed, _losses  # noqa: E402
from _tp_checks import assert_exact  # noqa: E402

# ---- config ----------------------------------------------------------------------------------


def test_validate_accepts_tensor_parallel():
    assert validate(CoreAttention(enable=True), dp_size=2, tp_degree=2) == 2  # -1: all DP ranks (not x TP)
    assert validate(CoreAttention(enable=True, degree=2), dp_size=4, tp_degree=4) == 2
    assert validate(CoreAttention(pingpong=True), dp_size=2, tp_degree=2) == 1  # CAD off: nothing to reject


def test_validate_accepts_tensor_parallel_with_nano_batches():
    """Ping-pong (and sequential nano-batches) with TP: accepted, seq_len permitting."""
    for cfg in (CoreAttention(enable=True, pingpong=True), CoreAttention(enable=True, nano_batches=2)):
        assert validate(cfg, dp_size=2, tp_degree=2, seq_len=512) == 2
        assert validate(cfg, dp_size=2, tp_degree=8, pp_degree=4, seq_len=65536) == 2  # the shipped 4D shape
    assert validate(CoreAttention(enable=True, pingpong=True), dp_size=2, tp_degree=2) == 2  # seq_len unknown: not checked


@pytest.mark.parametrize(
    "cfg, kwargs, match",
    [
        (
            CoreAttention(enable=True, pingpong=True), dict(tp_degree=2, seq_len=510),
            r"core_attention.nano_batches=-1 \(pingpong=true, resolved to 2 nano-batches\) with "
            r"parallelism.tensor_parallel_degree=2 needs training.seq_len divisible by nano_batches \* "
            r"tensor_parallel_degree = 4, got seq_len=510",
        ),
        (
            CoreAttention(enable=True, nano_batches=2), dict(tp_degree=8, seq_len=1032),
            r"core_attention.nano_batches=2 \(pingpong=false, resolved to 2 nano-batches\) with "
            r"parallelism.tensor_parallel_degree=8 needs training.seq_len divisible by .* = 16, got seq_len=1032",
        ),
        (
            CoreAttention(enable=True, pingpong=True), dict(tp_degree=2, seq_len=512, async_tp=True),
            r"cannot be combined with parallelism.enable_async_tensor_parallel=true",
        ),
    ],
)
def test_validate_rejects_what_nano_batches_with_tp_cannot_run(cfg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate(cfg, dp_size=2, **kwargs)
    if not kwargs.get("async_tp"):  # the same job without nano-batches is fine
        validate(CoreAttention(enable=True), dp_size=2, **kwargs)


def test_job_validation_checks_training_and_validation_seq_len():
    """The converter, the loader and the validator all run ``validate_job``: both sequence lengths."""
    from torchtitan_ext.config import validate_job

    from _titan import _job

    job = _job(CoreAttention(enable=True, pingpong=True), seq_len=66)
    job.parallelism.tensor_parallel_degree = 2
    with pytest.raises(ValueError, match=r"needs training.seq_len divisible by .* = 4, got seq_len=66"):
        validate_job(job.core_attention, job, 2)
    job.training.seq_len = 64
    job.validation = type("V", (), {"enable": True, "seq_len": 34, "local_batch_size": 1})()
    with pytest.raises(ValueError, match=r"validation.seq_len=34 must be divisible by nano_batches \* tensor_parallel_degree = 4"):
        validate_job(job.core_attention, job, 2)
    job.validation.seq_len = 32
    assert validate_job(job.core_attention, job, 2) == 2


# ---- the CA mesh -----------------------------------------------------------------------------


def _expected_ca_group(rank: int, tp: int, degree: int) -> list[int]:
    """World ranks of ``rank``'s CA group: the ``degree``-block of batch ranks around its batch
    rank, all with its TP rank (world rank = batch rank * tp + TP rank, pp = cp = 1)."""
    b, t = divmod(rank, tp)
    g = b // degree
    return [(g * degree + i) * tp + t for i in range(degree)]


@pytest.mark.parametrize(
    "dp_replicate, dp_shard, tp, degree",
    [(1, 2, 1, 2), (1, 2, 2, 2), (1, 2, 2, 1), (1, 4, 2, 2), (2, 2, 2, 2), (1, 4, 2, 4), (2, 2, 2, 4), (1, 2, 4, 2)],
)
def test_ca_mesh_layout_against_torchtitan_meshes(dp_replicate, dp_shard, tp, degree):
    """Every rank of a world of up to 8 (fake process groups, one process): the CA group is the
    ``degree`` consecutive batch ranks of torchtitan's "batch" mesh that share one TP rank of its
    "tp" mesh, and the CA rank is ``batch_rank % degree`` (the loader's convention)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims

    from torchtitan_ext.ca_mesh import build_ca_mesh

    W = dp_replicate * dp_shard * tp
    for rank in range(W):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=W)
        try:
            pd = ParallelDims(
                dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=W
            )
            pd.build_mesh()
            mesh = build_ca_mesh(pd, degree)
            batch_rank = pd.get_mesh("batch").get_local_rank()
            tp_rank = pd.get_mesh("tp").get_local_rank() if tp > 1 else 0
            assert mesh.mesh_dim_names == (("ca_outer", "ca", "ca_tp") if tp > 1 else ("ca_outer", "ca"))
            group = mesh["ca"].mesh.tolist()
            assert group == _expected_ca_group(rank, tp, degree), (rank, group)
            assert dist.get_process_group_ranks(mesh.get_group("ca")) == group
            assert mesh.get_local_rank("ca") == batch_rank % degree
            assert all(r % tp == tp_rank for r in group)  # one TP rank: the same heads
            first = batch_rank - batch_rank % degree
            assert [r // tp for r in group] == list(range(first, first + degree))  # consecutive batch ranks
        finally:
            dist.destroy_process_group()


def test_converter_rejects_tp_not_dividing_heads():
    """16 heads over 3 TP ranks: whole heads per rank are impossible; a clear error at convert."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.model.model import Transformer
    from torchtitan.protocols import train_spec as ts

    from _titan import _job
    from torchtitan_ext.converter import CoreAttentionConverter

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=3, pp=1, ep=1, etp=1, world_size=3)
        job = _job(CoreAttention(enable=True))
        job.parallelism.tensor_parallel_degree = 3
        conv = CoreAttentionConverter(job, pd)
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(ts.get_train_spec("llama3").model_args["debugmodel"]))
        with pytest.raises(ValueError, match=r"tensor_parallel_degree=3 must divide the model's n_heads=16 and n_kv_heads=16"):
            conv.convert(model)
    finally:
        dist.destroy_process_group()


def _mesh_worker(rank, world):
    """dp_shard 2 x tp 2 on 4 gloo ranks: CA groups, the loader, the converter's shape."""
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.protocols import train_spec as ts

    from torchtitan_ext import data
    from torchtitan_ext.ca_mesh import build_ca_mesh
    from torchtitan_ext.converter import CoreAttentionConverter
    from torchtitan_ext.train import build_dataloader

    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=world)
    pd.build_mesh()
    batch_mesh, tp_mesh = pd.get_mesh("batch"), pd.get_mesh("tp")
    out = {"batch_rank": batch_mesh.get_local_rank(), "tp_rank": tp_mesh.get_local_rank()}
    for degree in (1, 2):
        mesh = build_ca_mesh(pd, degree)
        pg = mesh.get_group("ca")
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=pg)  # the group really is those ranks
        tp_ranks = [torch.zeros(1, dtype=torch.long) for _ in range(degree)]
        dist.all_gather(tp_ranks, torch.tensor([out["tp_rank"]]), group=pg)
        out[degree] = {
            "ranks": dist.get_process_group_ranks(pg), "ca_rank": mesh.get_local_rank("ca"), "sum": x.item(),
            "tp_ranks_in_group": [int(t) for t in tp_ranks],
        }  # fmt: skip

    # The loader torchtitan builds: dp_rank is the batch rank (TP peers share it).
    job = ConfigManager().parse_args(
        [
            "--job.config_file", str(ROOT / "train_configs/debug_cpu.toml"), "--training.dataset", "synthetic_pretrain",
            "--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2", "--core_attention.degree", "2",
            "--model.hf_assets_path", str(data.TOKENIZER_PATH),
        ]
    )  # fmt: skip
    it = iter(build_dataloader(batch_mesh.size(), batch_mesh.get_local_rank(), data.load_tokenizer(), job))
    batches = [next(it) for _ in range(2)]
    flat = torch.cat(
        [torch.cat([d["input"].flatten(), d["positions"].flatten(), d["cu_seqlens"].flatten(), y.flatten()]) for d, y in batches]
    ).long()
    peers = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(peers, flat, group=tp_mesh.get_group())
    batch_peers = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(batch_peers, flat, group=batch_mesh.get_group())
    out["tp_peers_same_data"] = torch.equal(peers[0], peers[1])
    out["batch_peers_differ"] = not torch.equal(batch_peers[0], batch_peers[1])
    out["cu_seqlens_total"] = int(batches[0][0]["cu_seqlens"][-1])

    # The converter: its mesh is the one above, its planner shape has this TP rank's heads.
    conv = CoreAttentionConverter(job, pd)
    args = dataclasses.replace(ts.get_train_spec("llama3").model_args["debugmodel"])
    from torchtitan.models.llama3.model.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    conv.convert(model)
    shape = conv.planner.shape
    out["shape"] = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes)
    out["converter_ranks"] = dist.get_process_group_ranks(conv.planner.group)
    return out


@pytest.mark.slow
def test_ca_groups_loader_and_shape_with_tensor_parallel():
    """4 gloo ranks, dp_shard 2 x tp 2 (torchtitan's ParallelDims), CA degree 2: the "ca" groups are
    {0, 2} and {1, 3} (the batch ranks of one TP rank); CA rank = batch rank % degree; TP peers get
    identical batches from ``train.build_dataloader`` and batch ranks different ones; the planner's
    shape has the 8 local heads of the debug model's 16."""
    res = run_workers(_mesh_worker, 4, timeout=240)
    for rank, r in enumerate(res):
        assert (r["batch_rank"], r["tp_rank"]) == divmod(rank, 2)
        assert r[2]["ranks"] == [rank % 2, rank % 2 + 2] and r[2]["ca_rank"] == r["batch_rank"]
        assert r[2]["sum"] == sum(r[2]["ranks"]) and r[2]["tp_ranks_in_group"] == [r["tp_rank"]] * 2
        assert r[1]["ranks"] == [rank] and r[1]["ca_rank"] == 0
        assert r["tp_peers_same_data"] and r["batch_peers_differ"]
        assert r["cu_seqlens_total"] == 2 * 64  # one stream of degree * seq_len tokens per CA group
        assert r["shape"] == (8, 8, 16, 4) and r["converter_ranks"] == r[2]["ranks"]


# ---- nano-batches with TP: exact against a one-process fp64 reference (4 gloo ranks) ------------


@pytest.mark.slow
def test_pingpong_with_tensor_parallel_is_exact():
    """dp_shard 2 x tp 2 (``tests/_tp_nano.py``: torchtitan's ParallelDims and TP plan, the converter,
    the loader's rows), one document across both CA ranks and the nano-batch split: ping-pong's logits
    (each rank's rows, un-permuted by the loader's index) and parameter gradients (``full_tensor()``,
    summed over the batch ranks) match the unconverted model run on the whole window in one process
    in fp64 with per-document attention; sequential nano-batches (``nano_batches = 2`` without
    ping-pong, the same plans) give the same bits. The deliberately wrong variant, ping-pong on rows
    without the TP-major order, is far off: each gathered half then mixes both nano-batches.

    Measured: logits within 1.1e-6 (max |logits| 3.9-4.1), gradients within 4.3e-7 of each
    reference gradient's max; the wrong order misses by 0.075-0.078 (logits) and 1.44 (gradients)."""
    import _tp_nano

    res = run_workers(_tp_nano.worker, 4, ("pingpong", "sequential", "no_tp_order"), timeout=300)
    # 9 parameters per block, embeddings, norm, output; the negative control (rows not TP-major)
    # fails the same check by orders of magnitude.
    assert_exact(res, n_params=2 * 9 + 3, wrong={"no_tp_order": (100.0, None)})


# ---- end to end (torchrun) -------------------------------------------------------------------
#
# The same global batch (one CA group of 1024 tokens: 2 batch ranks x 512) and seed checkpoint,
# fp32, deterministic; with TP each batch rank is 2 processes holding 8 of the 16 heads.

@pytest.fixture(scope="module")
def dp2_tp2(titan_dir, seed_ckpt):
    """dp_shard 2 x tp 2 on 4 processes, CAD on (one CA group per TP rank), 512 tokens per batch rank."""
    return _from_seed(
        4, titan_dir, seed_ckpt, "dp2_tp2", "--training.seq_len", "512", "--parallelism.tensor_parallel_degree", "2",
    )  # fmt: skip


@pytest.mark.slow
def test_tensor_parallel_matches_data_parallel(dp2_tp2, two):
    """``torchrun --nproc_per_node 4`` with tensor_parallel_degree 2 (dp_shard 2) and CAD on = the
    2-process run without TP (the session's ``two``: same seed checkpoint, same windows); the CA
    plan is the same and its bytes are halved (each TP rank's group dispatches 8 heads).

    Measured: losses within ~1.2e-7 relative, grad norms within ~8e-6. The tolerances are tighter
    than the other end-to-end tests' because random tokens keep the loss near ln 2048: with the CA
    group wrongly taken as the two TP peers of one batch rank ({0, 1}: same tokens, different
    heads) the losses move by only 1e-6..1.4e-4 and the grad norms by 1e-5..7e-4."""
    dp, tp = two, dp2_tp2
    log = tp[0]
    assert "Applied Tensor Parallelism to the model" in log and "Applied FSDP to the model" in log, log[-4000:]
    assert "CA group of 2 ranks, 8 query / 8 KV heads per rank, TP 2" in log, log[-4000:]
    assert "group of 2" in log.split("summary:")[-1]
    ref = _losses(dp)
    assert len(ref) == _STEPS and _losses(tp) == pytest.approx(ref, rel=1e-5), (_losses(tp), ref)
    gn, gn_ref = (list(r[1]["grad_norm"].values()) for r in (tp, dp))
    assert gn == pytest.approx(gn_ref, rel=5e-5), (gn, gn_ref)
    for tag in ("ca/imbalance", "ca/docs"):
        assert tp[1][tag] == pytest.approx(dp[1][tag], rel=1e-6), tag
    half = {s: v / 2 for s, v in dp[1]["ca/fwd_MiB_per_layer"].items()}
    assert tp[1]["ca/fwd_MiB_per_layer"] == pytest.approx(half, rel=1e-5)


@pytest.mark.slow
def test_trainer_pingpong_with_tensor_parallel_matches_the_tp_run(titan_dir, seed_ckpt, dp2_tp2):
    """The same dp_shard 2 x tp 2 job with ``--core_attention.pingpong``: the loader lays each rank's
    rows out TP-major, each nano-batch's TP all-gathers and reduce-scatters run per nano-batch, and
    training matches the TP run without nano-batches (the tolerances above: losses rel 1e-5, grad
    norms 5e-5; nano-batches sum the per-rank losses in another order)."""
    pp = _from_seed(
        4, titan_dir, seed_ckpt, "dp2_tp2_pingpong", "--training.seq_len", "512",
        "--parallelism.tensor_parallel_degree", "2", "--core_attention.pingpong",
    )  # fmt: skip
    log = pp[0]
    assert "Applied Tensor Parallelism to the model" in log, log[-4000:]
    assert re.search(r"CA group of 2 ranks, 8 query / 8 KV heads per rank, TP 2, .*2 nano-batch\(es\), ping-pong", log), log[-4000:]
    assert "rows TP-major for tp=2" in log, log[-4000:]
    ref = _losses(dp2_tp2)
    assert len(ref) == _STEPS and _losses(pp) == pytest.approx(ref, rel=1e-5), (_losses(pp), ref)
    gn, gn_ref = (list(r[1]["grad_norm"].values()) for r in (pp, dp2_tp2))
    assert gn == pytest.approx(gn_ref, rel=5e-5), (gn, gn_ref)
    assert sorted(pp[1]["ca/exposed_comm_s"]) == list(range(1, _STEPS + 1))


@pytest.mark.slow
def test_trainer_pingpong_with_tensor_parallel_compiles(titan_dir, seed_ckpt, dp2_tp2):
    """The shipped 4D config's combination: TP 2 with ping-pong and ``--compile.enable`` (the pieces
    around core attention compile, the nano-batch schedule stays eager) trains exactly as the
    compiled TP run without nano-batches (measured: the same losses and grad norms), which trains
    as the eager TP run within the suite's compiled-vs-eager tolerance (losses rel 1e-4; measured
    1.2e-5; its grad norms sit 0.17 % below eager's with or without ping-pong). Nothing compiles
    after the first step. The second compiled run reads the graphs the first one cached: with one
    cache for all ranks a rank loaded another TP group's compiled loss and stopped ("Could not
    resolve the process group registered under the name 12"); each rank now has its own
    (``torchtitan_ext.compile_cache``)."""
    common = ("--training.seq_len", "512", "--parallelism.tensor_parallel_degree", "2", "--compile.enable")
    compiled = _from_seed(4, titan_dir, seed_ckpt, "dp2_tp2_compiled", *common)
    pc = _from_seed(4, titan_dir, seed_ckpt, "dp2_tp2_pingpong_compiled", *common, "--core_attention.pingpong")
    log = pc[0]
    assert "rows TP-major for tp=2" in log and "compiled" in log, log[-4000:]
    assert _losses(pc) == pytest.approx(_losses(compiled), rel=1e-6), (_losses(pc), _losses(compiled))
    gn, gn_ref = (list(r[1]["grad_norm"].values()) for r in (pc, compiled))
    assert len(gn) == _STEPS and gn == pytest.approx(gn_ref, rel=1e-6), (gn, gn_ref)
    ref = _losses(dp2_tp2)
    assert len(ref) == _STEPS and _losses(compiled) == pytest.approx(ref, rel=1e-4), (_losses(compiled), ref)
    assert re.search(r"torch\.compile: \d+ graphs in step 1, 0 more after", log), log[-4000:]
