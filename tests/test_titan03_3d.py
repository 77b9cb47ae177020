"""The 3D feature set on torchtitan 0.3: ping-pong (nano-batches), tensor parallelism, both
together, and ``torch.compile`` with CAD, CAD against a one-process reference, the 8B registry
configs, no MFU on CPU. torchtitan 0.3.0's own Trainer on gloo CPU processes, the llama3 debug
model; TP with ping-pong also in gloo workers against an fp64 reference (tests/_titan03_tp_nano.py).

Every training run starts from one seed checkpoint (FSDP-sharded, TP-sharded and unsharded
``init_weights`` draw different numbers) and trains on the same windows: one CA group of 1024
tokens per step (2 ranks x 512, or one process x 1024 for the reference), fp32, deterministic.
Tolerances are the 0.2.2 suite's for the same comparisons (tests/test_torchtitan_ext.py,
tests/test_pingpong.py, tests/test_tensor_parallel.py), tighter where a test says why.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _titan03 import LANE, REGISTRY, ROOT, scalars
from _tp_checks import assert_exact, block_orders, one_order

pytestmark = [LANE, pytest.mark.titan03]

_STEPS = 6
_WINDOW = 1024
_COMMON = (
    "--training.steps", str(_STEPS), "--dataloader.dataset", "synthetic_pretrain", "--debug.seed", "42",
    "--debug.deterministic", "--metrics.enable_tensorboard",
    # The kernel-only H200 model prices no bytes, so on these short windows distca moves work where
    # the CPU model (which pays for gloo's bytes) would plan exactly as colocated.
    "--core_attention.cost_model", "h200",
)  # fmt: skip
_REFERENCE = ROOT / "tests" / "titan03_reference_train.py"
_VALIDATION = (
    "--validator.enable", "--validator.freq", "3", "--validator.steps", "2",
    "--validator.dataloader.dataset", "synthetic_pretrain",
)  # fmt: skip
"""torchtitan's validator at steps 1, 3 and 6, 2 batches each (the registry's seed: 43)."""
_TP2 = ("--parallelism.tensor_parallel_degree", "2", *_VALIDATION)
"""dp_shard 2 x tp 2 on 4 processes, validating (the TP runs' flags: one run, shared by name)."""


def _torchrun(nproc: int, folder: Path, *args: str, launcher: Path | None = None, timeout: float = 400):
    """``torchrun --standalone`` of the 0.3 launcher (or a test launcher script) with the debug
    registry config; (exit code, rank 0's log). As ``_titan03.torchrun``, plus ``launcher``."""
    target = [str(launcher)] if launcher is not None else ["-m", "torchtitan_ext.titan03.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--local-ranks-filter", "0", *target, *REGISTRY, "--dump_folder", str(folder), *args]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory) -> Path:
    """One unsharded seed checkpoint (one process, torchtitan's ``--checkpoint.create_seed_checkpoint``)."""
    folder = tmp_path_factory.mktemp("seed")
    rc, log = _torchrun(1, folder, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    assert rc == 0 and "Created seed checkpoint" in log, log[-6000:]
    return folder / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def run(tmp_path_factory, seed_ckpt):
    """``run(name, nproc, *flags)``: a training run from the seed checkpoint, made once per module:
    (rank 0's log, TensorBoard scalars, dump folder)."""
    done = {}

    def go(name: str, nproc: int, *args: str, batch_ranks: int | None = None, launcher: Path | None = None):
        """``batch_ranks``: ranks sharing the window (default ``nproc``; with TP fewer)."""
        if name not in done:
            folder = tmp_path_factory.mktemp(name)
            t0 = time.monotonic()
            rc, log = _torchrun(
                nproc, folder, "--training.seq_len", str(_WINDOW // (batch_ranks or nproc)), *_COMMON, "--checkpoint.enable",
                "--checkpoint.initial_load_path", str(seed_ckpt), "--checkpoint.load_only", *args, launcher=launcher,
            )  # fmt: skip
            assert rc == 0 and "Training completed" in log, log[-6000:]
            print(f"{name}: {time.monotonic() - t0:.1f} s")  # the lane's cost, per run (pytest -s)
            done[name] = (log, scalars(folder), folder)
        return done[name]

    return go


def _series(r, tag: str) -> list[float]:
    values = r[1][tag]
    return [values[s] for s in sorted(values)]


def _distca(run):
    return run("distca", 2)


# ---- CAD on vs CAD off, and a one-process reference ------------------------------------------


@pytest.mark.slow
def test_cad_and_colocated_match_a_one_process_sdpa_reference(run):
    """CAD on (``policy distca``: attention moved between the 2 ranks) and CAD "off" on CPU
    (``colocated``: the same kernel, every rank serving its own rows; torchtitan 0.3's own varlen
    has no CPU kernel) give bit-identical losses and grad norms, and both equal one process with
    plain SDPA and an explicit block-causal mask over the whole 1024-token window
    (tests/titan03_reference_train.py: no distca code) within the 0.2.2 suite's tolerances:
    losses rel 1e-4, grad norms rel 1e-3. The grad norm is the sharp check: attention across
    documents moves the reference's grad norms by ~5e-2 (measured on 0.2.2)."""
    ca, colo = _distca(run), run("colocated", 2, "--core_attention.policy", "colocated")
    ref = run("reference", 1, "--core_attention.no-enable", launcher=_REFERENCE)
    assert "ca/docs" not in ref[1] and "use distca" not in ref[0]  # CAD really off in the reference
    assert min(ca[1]["ca/docs"].values()) > 5  # many documents per window, a new layout each step
    # distca moved work in some step; colocated never moves any (only K/V of documents that cross ranks).
    tb, tc = ca[1], colo[1]
    assert any(tb["ca/imbalance"][s] < tb["ca/imbalance_colocated"][s] - 1e-3 for s in tb["ca/imbalance"])
    assert all(tc["ca/imbalance"][s] == tc["ca/imbalance_colocated"][s] for s in tc["ca/imbalance"])
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        assert len(_series(ca, tag)) == _STEPS and _series(ca, tag) == _series(colo, tag), tag
    for r in (ca, colo):
        assert _series(r, "loss_metrics/global_avg_loss") == pytest.approx(_series(ref, "loss_metrics/global_avg_loss"), rel=1e-4)
        assert _series(r, "grad_norm") == pytest.approx(_series(ref, "grad_norm"), rel=1e-3)


# ---- ping-pong / nano-batches (CANanoBlock) ------------------------------------------------------


@pytest.mark.slow
def test_pingpong_is_bit_equal_to_sequential_nano_batches_and_trains_as_whole_rows(run):
    """``--core_attention.pingpong`` (two nano-batches, one's all-to-alls in flight while the other
    computes) gives bit-equal losses and grad norms to ``--core_attention.nano_batches 2`` without
    ping-pong (the same ops on the same rows, another order of the exchanges), and trains as whole
    rows (``distca``) within rel 1e-5, the 0.2.2 suite's tolerance: nano-batches keep documents
    whole, so only the per-rank sums' order differs."""
    seq = run("nano", 2, "--core_attention.nano_batches", "2")
    pp = run("pingpong", 2, "--core_attention.pingpong")
    whole = _distca(run)
    assert "2 nano-batches, ping-pong" in pp[0] and "2 nano-batches)" in seq[0], pp[0][-3000:]
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        assert len(_series(pp, tag)) == _STEPS and _series(pp, tag) == _series(seq, tag), tag
        assert _series(pp, tag) == pytest.approx(_series(whole, tag), rel=1e-5), tag
    # Rows moved (the interleaved schedule ran, with communication to hide) in some step.
    assert any(v > 0 for v in pp[1]["ca/fwd_MiB_per_layer"].values())
    assert sorted(pp[1]["ca/exposed_comm_s"]) == list(range(1, _STEPS + 1))
    assert pp[0].count(" exposed comm ") == _STEPS
    assert re.search(r"exchanges   [0-9.]+ s/step blocked in CA exchange waits", pp[0]), pp[0][-3000:]


# ---- tensor parallelism -----------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_matches_data_parallel(run):
    """4 processes, ``--parallelism.tensor_parallel_degree 2`` x dp 2, CAD on: each TP rank runs
    core attention on its 8 of the 16 heads (torchtitan's local_map hands our module the local
    q/k/v), in the CA group of the batch ranks that hold them ({0, 2} and {1, 3}); the same losses
    (rel 1e-5) and grad norms (rel 5e-5) as the 2-process run without TP, the same plan, half its
    bytes. (0.2.2: a CA group wrongly taken as the two TP peers of one batch rank moves the losses
    by 1e-6..1.4e-4 and the grad norms by 1e-5..7e-4.)"""
    tp = run("tp", 4, *_TP2, batch_ranks=2)
    dp = _distca(run)
    log = tp[0]
    assert "CA group of 2 ranks, 8 query / 8 KV heads per rank (TP 2)" in log, log[-4000:]
    assert "Applied FSDP to the model" in log, log[-4000:]
    assert _series(tp, "loss_metrics/global_avg_loss") == pytest.approx(_series(dp, "loss_metrics/global_avg_loss"), rel=1e-5)
    assert _series(tp, "grad_norm") == pytest.approx(_series(dp, "grad_norm"), rel=5e-5)
    for tag in ("ca/imbalance", "ca/docs"):
        assert tp[1][tag] == pytest.approx(dp[1][tag], rel=1e-6), tag
    half = {s: v / 2 for s, v in dp[1]["ca/fwd_MiB_per_layer"].items()}
    assert tp[1]["ca/fwd_MiB_per_layer"] == pytest.approx(half, rel=1e-5)


@pytest.mark.slow
def test_pingpong_with_tensor_parallel_matches_the_tp_run(run):
    """dp_shard 2 x tp 2 (4 processes) with ``--core_attention.pingpong``: the loader lays each
    rank's row out TP-major, each half of a TP rank's sequence shard gathers (the attention's
    declared input redistribution, run by the nano-batch block) to one nano-batch in stream order,
    positions are cut back per nano-batch, ``wo``/FFN reduce-scatter per nano-batch. Training
    matches the same TP run without nano-batches: the same rows and documents, only the per-rank
    sums run in another order (rows TP-major) and the plans split documents differently.

    Tolerances: losses rel 2e-6, grad norms rel 5e-7, tighter than 0.2.2's e2e check of this
    comparison (1e-5, 5e-5), because the debug model at its initial weights attends almost
    uniformly and wrong RoPE positions move its losses little. Measured on three seed checkpoints
    (each session draws its own): losses within 2.4e-7, grad norms 1.1e-7, validation losses
    1.2e-7. Deliberately broken, on one seed checkpoint each: rows not
    TP-major (loader tp 1) miss by 1.6e-4 (losses) and 1.6e-3 (grad norms); positions not cut per
    TP shard (``nano_positions(positions, 1)``) by 6.6e-6 and 1.9e-6."""
    pp = run("tp_pingpong", 4, *_TP2, "--core_attention.pingpong", batch_ranks=2)
    tp = run("tp", 4, *_TP2, batch_ranks=2)
    log = pp[0]
    assert "TP 2, 2 nano-batches, ping-pong" in log and "rows TP-major for tp=2" in log, log[-4000:]
    assert "CA group of 2 ranks, 8 query / 8 KV heads per rank (TP 2), 2 nano-batch(es)" in log, log[-4000:]
    for tag, rel in (("loss_metrics/global_avg_loss", 2e-6), ("grad_norm", 5e-7)):
        assert len(_series(pp, tag)) == _STEPS and _series(pp, tag) == pytest.approx(_series(tp, tag), rel=rel), tag
    # Validation (its loader TP-major too, the trainer sets both) at steps 1, 3 and 6: the same losses.
    val = "validation_metrics/loss"
    assert sorted(pp[1][val]) == sorted(tp[1][val]) == [1, 3, 6], (pp[1][val], tp[1][val])
    assert _series(pp, val) == pytest.approx(_series(tp, val), rel=2e-6)
    # Rows moved between the CA ranks in some step (the interleaved schedule had exchanges to hide).
    assert any(v > 0 for v in pp[1]["ca/fwd_MiB_per_layer"].values())
    assert sorted(pp[1]["ca/exposed_comm_s"]) == list(range(1, _STEPS + 1))


# Nano-batches with TP against a one-process fp64 reference, and the collectives' order
# (tests/_titan03_tp_nano.py: dp_shard 2 x tp 2 on 4 gloo workers, torchtitan 0.3's own parallelize).

@pytest.fixture(scope="module")
def tp_nano():
    """One spawn of the 4 workers: ping-pong, sequential nano-batches and the two wrong variants,
    every collective recorded."""
    import _titan03_tp_nano

    from dist_utils import run_workers

    return run_workers(
        _titan03_tp_nano.worker, 4, ("pingpong", "sequential", "no_tp_order", "uncut_positions"), True, timeout=400
    )


@pytest.mark.slow
def test_pingpong_with_tensor_parallel_is_exact(tp_nano):
    """dp_shard 2 x tp 2, torchtitan 0.3's ``ParallelDims`` and ``Module.parallelize`` (llama3's
    sequence-parallel sharding configs, partial_dtensor) on the converted 2-layer debug model
    (``CANanoBlock``), one document across both CA ranks and the nano-batch split: ping-pong's
    logits (each rank's rows, un-permuted by the loader's index) and parameter gradients
    (``full_tensor()``, summed over the batch ranks) match the unconverted model on the whole window
    in one process in fp64 with per-document SDPA; sequential nano-batches give the same bits.
    The deliberately wrong variants are far off: rows without the TP-major order (each gathered
    half then mixes both nano-batches) and positions not cut per TP shard (RoPE of other rows).

    Measured: logits within 2.0e-6 (max |logits| 4.3-5.5), gradients within 6.1e-7 of each
    reference gradient's max; rows not TP-major miss by 0.34-0.36 (logits) and 1.2 (gradients),
    positions uncut by 0.0073-0.011 and 0.057."""
    # 7 parameters per block, embeddings, norm, output; the negative controls (rows not TP-major,
    # positions not cut per TP shard) fail the same checks by an order of magnitude and more.
    assert_exact(tp_nano, n_params=2 * 7 + 3, wrong={"no_tp_order": (10.0, 100.0), "uncut_positions": (10.0, 100.0)})


@pytest.mark.slow
def test_pingpong_with_tensor_parallel_issues_one_collective_order_on_every_rank(tp_nano):
    """The same forward and backward, every collective recorded (DTensor's redistributions too):
    every rank issues one sequence of (TP or CA group, collective, forward/backward, size), so the
    two groups cannot deadlock (tests/test_per_layer.py's argument). Forward, per block, the
    paper's order with each nano-batch's TP collectives in its own compute phases: nano-batch 0's
    all-gather (the attention's declared input redistribution, run by the block), its two
    dispatches, nano-batch 1's all-gather and dispatches, both returns, then per nano-batch the
    reduce-scatter after ``wo``, the FFN's all-gather and ``w2``'s reduce-scatter, all of
    T / (2 tp) rows. Backward: the mirror, 4 all-gathers and 4 reduce-scatters per block of a
    nano-batch's size, 4 all-to-alls per nano-batch and layer, and only 2 TP collectives outside
    the blocks (the embedding's and the final norm's). Measured negative control: without the
    block's explicit input redistribution DTensor gathers implicitly in the forward (the same
    values) but the backward issues 16 more TP collectives, which this test refuses."""
    import _titan03_tp_nano as tn

    fwd, bwd = one_order(tp_nano, "pingpong")
    half = tn.T // (2 * tn.TP) * 256  # elements of a nano-batch's local shard [1, T / (2 tp), dim]
    block, one = block_orders(half)
    layers = tn.LAYERS
    assert fwd[1 : 1 + len(block) * layers] == block * layers, fwd  # after the embedding's all-gather
    assert bwd.count(("tp", "AG", half)) == 4 * layers and bwd.count(("tp", "RS", 2 * half)) == 4 * layers, bwd
    assert bwd.count(("ca", "A2A", None)) == 2 * 4 * layers, bwd
    assert sum(c[0] == "tp" for c in bwd) == 8 * layers + 2, bwd
    # The sequential schedule (nano_batches = 2 without ping-pong) is one order on every rank too.
    fwd_s, _ = one_order(tp_nano, "sequential")
    assert fwd_s[1 : 1 + len(one) * 2 * layers] == one * 2 * layers, fwd_s


# ---- torch.compile ------------------------------------------------------------------------------


def _graphs(log: str) -> tuple[int, int]:
    m = re.search(r"torch.compile: (\d+) graphs in step 1, (\d+) more after", log)
    assert m, log[-4000:]
    return int(m[1]), int(m[2])


@pytest.mark.slow
def test_compile_matches_eager_without_recompiles(run):
    """``--compile.enable``: torchtitan compiles every block (``fullgraph=True``) with core
    attention inside; a new plan and document layout every step reach the compiled blocks as a
    tensor handle, so nothing recompiles after step 1; the losses are eager's (rel 1e-4, 0.2.2's)."""
    comp, eager = run("compiled", 2, "--compile.enable"), _distca(run)
    first, more = _graphs(comp[0])
    assert first >= 1 and more == 0, comp[0][-4000:]
    assert "Compiling each TransformerBlock with torch.compile" in comp[0]
    assert _series(comp, "loss_metrics/global_avg_loss") == pytest.approx(_series(eager, "loss_metrics/global_avg_loss"), rel=1e-4)
    assert comp[0].count("attn n/a (compiled)") == _STEPS


@pytest.mark.slow
def test_pingpong_compiles_its_pieces_without_recompiles(run):
    """Ping-pong with ``--compile.enable``: the schedule stays eager (collectives between the
    pieces), the pieces before and after core attention compile, torchtitan's per-block compile is
    dropped; no recompile after step 1 and the eager ping-pong losses (rel 1e-4)."""
    comp, eager = run("pingpong_compiled", 2, "--core_attention.pingpong", "--compile.enable"), run(
        "pingpong", 2, "--core_attention.pingpong"
    )
    first, more = _graphs(comp[0])
    assert first >= 2 and more == 0, comp[0][-4000:]  # at least pre and post
    assert "Compiling each TransformerBlock" not in comp[0] and "ping-pong, compiled" in comp[0]
    assert _series(comp, "loss_metrics/global_avg_loss") == pytest.approx(_series(eager, "loss_metrics/global_avg_loss"), rel=1e-4)


@pytest.mark.slow
def test_pingpong_with_tensor_parallel_compiles(run):
    """dp_shard 2 x tp 2 with ping-pong and ``--compile.enable`` (the 4D config's combination): the
    compiled pieces take each nano-batch's half of the sequence shard as a DTensor of its own
    (copied: a view of the shard stops dynamo), and training is exactly the compiled TP run's
    without nano-batches (measured: equal losses and grad norms); that run trains as eager TP
    (losses rel 1e-4, the suite's compiled-vs-eager tolerance); nothing compiles after step 1. The
    second compiled run reads the graphs the first cached, per rank (``torchtitan_ext.compile_cache``).

    Without validation: with ``--validator.enable`` the compiled TP run (torchtitan's per-block
    compile, no nano-batches) stops in validation's forward inside torch's compiled DTensor
    wrapper ("'Tensor' object has no attribute 'elem'"); docs/guides/torchtitan03.md."""
    tp2 = _TP2[:2]  # no validation: compiled TP blocks fail in its no-grad forward, CAD's or not (below)
    tpc = run("tp_compiled", 4, *tp2, "--compile.enable", batch_ranks=2)
    ppc = run("tp_pingpong_compiled", 4, *tp2, "--core_attention.pingpong", "--compile.enable", batch_ranks=2)
    assert "TP 2, 2 nano-batches, ping-pong, compiled" in ppc[0], ppc[0][-4000:]
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        assert len(_series(ppc, tag)) == _STEPS and _series(ppc, tag) == pytest.approx(_series(tpc, tag), rel=1e-6), tag
    eager = run("tp", 4, *_TP2, batch_ranks=2)
    loss = "loss_metrics/global_avg_loss"
    assert _series(tpc, loss) == pytest.approx(_series(eager, loss), rel=1e-4)
    assert _graphs(ppc[0])[1] == 0, ppc[0][-4000:]


# ---- console ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_mfu_on_cpu(run):
    """torchtitan computes MFU against an A100's peak; on CPU the console says ``mfu: n/a on CPU``
    on every step line and never prints a percentage (the 0.2.2 adapter's behaviour)."""
    log = _distca(run)[0]
    assert log.count("mfu: n/a on CPU") == _STEPS and not re.search(r"mfu: [0-9.na]+%", log), log[-3000:]
    assert "MFU is not reported on CPU" in log and "Error running lspci" not in log


# ---- in-process: configs and start-up errors ------------------------------------------------


@pytest.fixture
def _cpu_patches():
    from torchtitan_ext.titan03 import _compat

    _compat.apply()


def _parse(*args: str, config: str = "llama3_debugmodel_ca"):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "torchtitan_ext.titan03", "--config", config, *args])


def test_cpu_peak_flops_is_nan_and_the_console_says_so(_cpu_patches, caplog):
    import logging

    import torchtitan.tools.utils as tu

    assert math.isnan(tu.get_peak_flops("cpu")) and tu.get_peak_flops("NVIDIA H200") == 989e12
    with caplog.at_level(logging.INFO):
        logging.getLogger().info(f"step:  1  loss:  7.00000  mfu: {float('nan'):.2f}%")
    assert caplog.records[-1].getMessage() == "step:  1  loss:  7.00000  mfu: n/a on CPU"


def test_8b_registry_config_parses_as_the_toml(_cpu_patches):
    """``--config llama3_8b_ca``: train_configs/llama3_8b_ca.toml's settings (one CA group of 8 per
    node, 32K tokens per rank, ping-pong, op-level SAC, compile), parsed only."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.titan03.trainer import CoreAttentionTrainer

    cfg = _parse("--training.steps", "3", config="llama3_8b_ca")
    assert type(cfg) is CoreAttentionTrainer.Config and cfg.training.steps == 3
    assert cfg.core_attention == CoreAttention(
        enable=True, degree=8, policy="distca", tolerance=0.05, mode="resend", min_shard=512, cost_model="h200",
        pingpong=True,
    )  # fmt: skip
    model = cfg.model_spec.model
    assert len(model.layers) == 32 and model.dim == 4096 and model.layers[0].attention.n_kv_heads == 8
    assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.mixed_precision_param) == (32768, 1, "bfloat16")
    assert cfg.compile.enable and cfg.compile.components == ["model", "loss"]
    assert type(cfg.activation_checkpoint) is SelectiveAC.Config and cfg.training.disable_cuda_graphs
    assert cfg.dataloader.dataset == "synthetic_prolong" and cfg.parallelism.tensor_parallel_degree == 1


def test_8b_4d_registry_config_parses_as_the_toml(_cpu_patches):
    """``--config llama3_8b_ca_4d``: train_configs/llama3_8b_ca_4d.toml's 4D settings (TP 8, 4
    Tick1F1B stages of 8 layers, one CA group across the stages, ping-pong), parsed only."""
    cfg = _parse(config="llama3_8b_ca_4d")
    p, ca = cfg.parallelism, cfg.core_attention
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.pipeline_parallel_schedule) == (8, 4, "Tick1F1B")
    assert (p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers) == (0, 0)
    assert ca.enable and ca.across_stages and ca.degree == -1 and ca.pingpong and cfg.compile.enable
    assert (cfg.training.seq_len, cfg.training.local_batch_size) == (65536, 8) and len(cfg.model_spec.model.layers) == 32


@pytest.mark.parametrize(
    "args, match",
    [
        (("--compile.enable", "--compile.enable_async_tensor_parallel"),
         r"tensor_parallel_degree=2 with --core_attention.nano_batches=2 \(resolved from --core_attention.pingpong=true\) "
         r"and --compile.enable_async_tensor_parallel is not supported by the torchtitan 0.3 adapter yet .* use "
         r"--compile.no-enable_async_tensor_parallel"),
        (("--parallelism.spmd_backend", "full_dtensor"),
         r"and --parallelism.spmd_backend=full_dtensor is not supported .* use --parallelism.spmd_backend partial_dtensor"),
        (("--parallelism.no-enable_sequence_parallel",),
         r"and --parallelism.no-enable_sequence_parallel is not supported .* use --parallelism.enable_sequence_parallel"),
        (("--training.seq_len", "1022"),
         r"tensor_parallel_degree=2 needs training.seq_len divisible by nano_batches \* tensor_parallel_degree = 4, "
         r"got seq_len=1022"),
    ],
    ids=["async_tp", "spmd_backend", "no_sequence_parallel", "seq_len"],
)  # fmt: skip
def test_what_tensor_parallel_with_pingpong_does_not_run_stops_at_start_up(_cpu_patches, args, match, capsys, monkeypatch):
    """TP + ping-pong runs (tests above; with PP: tests/test_titan03_pp.py); what it is not tested
    with stops at parse time, on every rank, naming the flags and what to set instead:
    async TP, another SPMD backend than the registry's partial_dtensor, sequence parallelism
    off, and a seq_len the TP-major rows cannot split (not a multiple of 2 * tp). The same flags
    without ping-pong parse."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        _parse("--parallelism.tensor_parallel_degree", "2", "--core_attention.pingpong", *args)
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert re.search(match, err), err
    _parse("--parallelism.tensor_parallel_degree", "2", *args)
    _parse("--parallelism.tensor_parallel_degree", "2", "--core_attention.pingpong")  # the tested combination


def test_ca_loader_lays_nano_batch_rows_out_tp_major(_cpu_patches):
    """The 0.3 CA loader with ``tp`` (set by the trainer from ``--parallelism.tensor_parallel_degree``)
    and two nano-batches: each item is the ``tp = 1`` item re-indexed TP-major (tokens, positions,
    labels), so TP rank t's sequence shard is [nano 0 chunk t | nano 1 chunk t] and its halves gather
    to each nano-batch in stream order; the layouts are unchanged. With one nano-batch ``tp`` changes
    nothing. Pure: no process group."""
    import torch

    from torchtitan_ext.data import tp_major_rows
    from torchtitan_ext.titan03.data import CADataLoader

    T, tp = 64, 2

    def items(nano: int, tp: int, n: int = 3) -> list:
        cfg = CADataLoader.Config(dataset="synthetic_pretrain", seed=3, ca_degree=2, nano_batches=nano, tp=tp)
        it = iter(cfg.build(dp_world_size=2, dp_rank=1, tokenizer=None, seq_len=T, local_batch_size=1))
        return [next(it) for _ in range(n)]

    for (d, lab), (base, base_lab) in zip(items(2, tp), items(2, 1), strict=True):
        for k in ("cu_seqlens", "cu_seqlens_1", "context_1"):
            assert torch.equal(d[k], base[k]), k
        for got, want in ((d["input"], base["input"]), (d["positions"], base["positions"]), (lab, base_lab)):
            assert torch.equal(got[0], want[0][tp_major_rows(T, tp)])
            shards = got[0].view(tp, T // tp)  # TP rank t's Shard(1) piece of the row
            for n in (0, 1):
                gathered = shards[:, n * T // (2 * tp) : (n + 1) * T // (2 * tp)].reshape(-1)
                assert torch.equal(gathered, want[0, n * T // 2 : (n + 1) * T // 2])
        assert not torch.equal(d["input"], base["input"])  # the order is not the identity on these rows
    for (d, lab), (base, base_lab) in zip(items(1, tp), items(1, 1), strict=True):
        assert torch.equal(d["input"], base["input"]) and torch.equal(lab, base_lab)


def test_nano_batch_conversion_swaps_each_block(_cpu_patches):
    """With two nano-batches every llama3 block config becomes ``CANanoBlock.Config`` with the same
    attention, norms and FFN; the model builds and passes torchtitan's Module protocol check."""
    import dataclasses

    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    import torch

    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.titan03.model import CANanoBlock, CoreAttentionModule, convert

    spec = model_registry("debugmodel", attn_backend="varlen")
    before = list(spec.model.layers)
    assert convert(spec.model, CoreAttention(pingpong=True), compile_pieces=True) == 6
    for layer, old in zip(spec.model.layers, before, strict=True):
        assert type(old) is Llama3TransformerBlock.Config
        assert type(layer) is CANanoBlock.Config and layer.compile_pieces
        assert isinstance(layer.attention.inner_attention, CoreAttentionModule.Config)
        # The very same sub-configs (attention converted in place, norms, FFN, sharding, init).
        assert all(getattr(layer, f.name) is getattr(old, f.name) for f in dataclasses.fields(Llama3TransformerBlock.Config))
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    assert all(type(b) is CANanoBlock for b in model.layers.values())
    with pytest.raises(RuntimeError, match=r"nano_batches=2 needs a StepPlan with two plans"):
        model.layers["0"](torch.zeros(1, 4, 256, device="meta"), None, torch.zeros(1, 4, dtype=torch.long, device="meta"))


def test_auto_kernel_is_the_one_torchtitans_varlen_activates(_cpu_patches, monkeypatch):
    """Like with like against CAD off: where torchtitan's varlen switches the process to FA3 (SM90)
    or FA4 (SM100), ``backend auto`` runs torch's varlen under that implementation; elsewhere (CPU)
    distca chooses; an explicit backend is kept."""
    import torchtitan.tools.utils as tu

    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.titan03.model import convert, kernel_backend

    assert kernel_backend("auto") == "auto" and kernel_backend("torch_varlen") == "torch_varlen"  # CPU here
    for impl, backend in (("FA3", "torch_fa3"), ("FA4", "torch_fa4"), (None, "auto")):
        monkeypatch.setattr(tu, "get_cuda_flash_attention_impl", lambda impl=impl: impl)
        assert kernel_backend("auto") == backend and kernel_backend("flash_attn") == "flash_attn"
        from torchtitan.models.llama3 import model_registry

        spec = model_registry("debugmodel", attn_backend="varlen")
        convert(spec.model, CoreAttention())
        assert {layer.attention.inner_attention.backend for layer in spec.model.layers} == {backend}
