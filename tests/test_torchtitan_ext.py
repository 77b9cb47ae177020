"""torchtitan_ext: config validation, CPU start-up patches, the attention module, end-to-end training.

The slow tests launch ``torchrun -m torchtitan_ext.train`` (2 processes, CPU/gloo) on the
debug model and check the CA metrics and loss parity with a one-process reference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in this process

from torchtitan_ext.config import CoreAttention, validate  # noqa: E402

from dist_utils import run_workers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# ---- config ----------------------------------------------------------------------------------


def test_validate_defaults_and_degree():
    assert validate(CoreAttention(), dp_size=4) == 1  # off: CA degree 1
    assert validate(CoreAttention(enable=True), dp_size=4) == 4  # -1: all DP ranks
    assert validate(CoreAttention(enable=True, degree=2), dp_size=4) == 2


@pytest.mark.parametrize(
    "cfg, kwargs, match",
    [
        (CoreAttention(enable=True, degree=3), {"dp_size": 4}, r"core_attention.degree=3 must divide the data-parallel size 4 \(valid: -1 or one of \[1, 2, 4\]\)"),
        (CoreAttention(enable=True, degree=0), {"dp_size": 4}, r"core_attention.degree=0 must divide"),
        (CoreAttention(enable=True), {"dp_size": 2, "cp_degree": 2}, r"cannot be combined with parallelism.context_parallel_degree=2"),
        (CoreAttention(enable=True), {"dp_size": 2, "tp_degree": 2}, r"data parallelism \(FSDP/HSDP\) only"),
        (CoreAttention(policy="fastest"), {"dp_size": 2}, r"core_attention.policy='fastest' is unknown; choose one of \['distca', 'greedy', 'per_doc_cp', 'colocated'\]"),
        (CoreAttention(mode="lazy"), {"dp_size": 2}, r"core_attention.mode='lazy' is unknown"),
        (CoreAttention(tolerance=1.5), {"dp_size": 2}, r"core_attention.tolerance=1.5 must be a number in \[0, 1\)"),
        (CoreAttention(min_shard=0), {"dp_size": 2}, r"core_attention.min_shard=0 must be an int >= 1"),
        (CoreAttention(pingpong=True), {"dp_size": 2}, r"core_attention.pingpong=true is not supported yet"),
    ],
)
def test_validate_errors(cfg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate(cfg, **kwargs)


def _job(ca=None, **training):
    from types import SimpleNamespace as NS

    return NS(
        core_attention=ca,
        parallelism=NS(context_parallel_degree=1, tensor_parallel_degree=1, pipeline_parallel_degree=1),
        training=NS(**{"local_batch_size": 1, "seq_len": 64, "mixed_precision_param": "float32", **training}),
        activation_checkpoint=NS(mode="none"),
    )


@pytest.mark.parametrize(
    "job, match",
    [
        (_job(None), r"needs the \[core_attention\] config section: set \[job\] custom_config_module"),
        (_job(CoreAttention(enable=True), local_batch_size=2), r"needs training.local_batch_size = 1, got 2"),
        (_job(CoreAttention(enable=True, degree=4)), r"core_attention.degree=4 must divide the data-parallel size 2"),
    ],
)
def test_converter_start_up_errors(job, match):
    from types import SimpleNamespace as NS

    from torchtitan_ext.converter import CoreAttentionConverter

    with pytest.raises(ValueError, match=match):
        CoreAttentionConverter(job, NS(dp_replicate=1, dp_shard=2))


def test_converter_rejects_keep_mode_with_activation_checkpointing():
    from types import SimpleNamespace as NS

    from torchtitan_ext.converter import CoreAttentionConverter

    job = _job(CoreAttention(enable=True, mode="keep"))
    job.activation_checkpoint.mode = "full"
    with pytest.raises(ValueError, match=r'mode="keep" cannot be combined with activation_checkpoint.mode="full"'):
        CoreAttentionConverter(job, NS(dp_replicate=1, dp_shard=2))


def test_every_key_is_a_cli_flag_and_toml_key(tmp_path):
    from torchtitan.config import ConfigManager

    toml = tmp_path / "job.toml"
    toml.write_text('[job]\ncustom_config_module = "torchtitan_ext.config"\n[core_attention]\nenable = true\ndegree = 2\n')
    cfg = ConfigManager().parse_args(
        [
            f"--job.config_file={toml}",
            "--core_attention.policy", "greedy",
            "--core_attention.tolerance", "0.1",
            "--core_attention.mode", "keep",
            "--core_attention.backend", "cpu",
            "--core_attention.min_shard", "64",
            "--core_attention.cost_model", "h200",
            "--core_attention.no-pingpong",
        ]
    )  # fmt: skip
    ca = cfg.core_attention
    assert (ca.enable, ca.degree, ca.policy, ca.tolerance, ca.mode) == (True, 2, "greedy", 0.1, "keep")
    assert (ca.backend, ca.min_shard, ca.cost_model, ca.pingpong) == ("cpu", 64, "h200", False)
    with pytest.raises(SystemExit):  # Literal choices are checked by the CLI parser
        ConfigManager().parse_args([f"--job.config_file={toml}", "--core_attention.policy", "fastest"])


# ---- _compat ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not applied with CUDA")
def test_compat_applies_once_on_cpu():
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc
    import torchtitan.distributed.utils as du
    import torchtitan.tools.utils as tu

    first = _compat.applied()
    assert {"cpu_device_type", "cpu_memory_monitor", "gloo_fsdp_sum", "cpu_pg_timeouts"} <= first
    objs = (fc._get_gradient_divide_factors, du.set_pg_timeouts, torch.cpu.get_device_name)
    assert _compat.apply() == first  # idempotent: nothing re-wrapped
    assert (fc._get_gradient_divide_factors, du.set_pg_timeouts, torch.cpu.get_device_name) == objs
    assert not hasattr(fc._get_gradient_divide_factors.__wrapped__, "__wrapped__")
    assert tu.device_type == "cpu" and tu.device_module is torch.cpu
    assert torch.cpu.memory_stats() == {} and torch.cpu.get_device_properties().total_memory > 0
    # gloo has no PREMUL_SUM: a divide factor of 1.0 (llama3's) must reduce with plain SUM on CPU.
    _, _, rs_op, ar_op = fc._get_gradient_divide_factors(None, None, torch.float32, "cpu", 1.0)
    assert rs_op == torch.distributed.ReduceOp.SUM and ar_op == torch.distributed.ReduceOp.SUM


def test_compat_without_cuda_only():
    """With CUDA (simulated) only the triton stub may be applied, and only if triton is missing."""
    code = (
        "import importlib.util, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from torchtitan_ext import _compat\n"
        "got = _compat.apply()\n"
        "want = set() if importlib.util.find_spec('triton') else {'triton_stub'}\n"
        "assert set(got) == want, got\n"
        "import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc\n"
        "assert not hasattr(fc._get_gradient_divide_factors, '__wrapped__')\n"
        "assert not hasattr(torch.cpu, 'get_device_name')\n"
        "print('ok')\n"
    )
    r = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_compat_refuses_late_import():
    code = (
        "from torchtitan_ext import _compat\n"
        "_compat._stub_moe_kernels()  # so that the bare import below gets as far as binding\n"
        "import torchtitan.tools.utils  # binds device_type='cuda' on a CPU machine\n"
        "try:\n"
        "    _compat.apply()\n"
        "except RuntimeError as e:\n"
        "    assert 'call apply() before importing torchtitan' in str(e), e\n"
        "    print('raised')\n"
    )
    if torch.cuda.is_available():
        pytest.skip("torchtitan binds 'cuda' legitimately here")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "raised" in r.stdout, r.stderr[-3000:]


# ---- the attention module (2 gloo processes) -------------------------------------------------


def _module_worker(rank, world, T, cu):
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext.converter import CoreAttentionModule, StepContext

    torch.manual_seed(0)
    Hq, Hkv, D = 4, 2, 16
    q_all = torch.randn(1, Hq, world * T, D, dtype=torch.float32)
    k_all = torch.randn(1, Hkv, world * T, D, dtype=torch.float32)
    v_all = torch.randn(1, Hkv, world * T, D, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ca_outer", "ca"))
    ctx = StepContext(cfg=CoreAttention(enable=True), mesh=mesh, degree=world)
    ctx.prepare(torch.tensor(cu))
    sl = slice(rank * T, (rank + 1) * T)
    q, k, v = (x[:, :, sl].clone().requires_grad_() for x in (q_all, k_all, v_all))
    out = CoreAttentionModule(ctx)(q, k, v, enable_gqa=True)  # torchtitan layout (1, H, T, D)
    out.square().sum().backward()

    # Reference: per-document causal SDPA over the whole stream, GQA by repeating KV heads.
    qa, ka, va = (x.clone().requires_grad_() for x in (q_all, k_all, v_all))
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                qa[:, :, a:b], ka[:, :, a:b].repeat_interleave(2, 1), va[:, :, a:b].repeat_interleave(2, 1), is_causal=True
            )
            for a, b in zip(cu[:-1], cu[1:])
        ],
        dim=2,
    )
    # Every rank's loss is the square-sum of its own rows, so the group's total loss is this.
    ref.square().sum().backward()
    stats, fwd_s, bwd_s = ctx.pop_stats()
    return (
        (out - ref[:, :, sl]).abs().max().item(),
        max((a.grad[:, :, sl] - b.grad).abs().max().item() for a, b in ((qa, q), (ka, k), (va, v))),
        stats[0].imbalance <= stats[0].imbalance_colocated + 1e-12,
        fwd_s > 0 and bwd_s > 0,
    )


@pytest.mark.slow
def test_attention_module_matches_document_sdpa():
    T, cu = 96, [0, 150, 160, 192]  # a document crossing the rank boundary, GQA 4:2
    results = run_workers(_module_worker, 2, T, cu, timeout=120)
    for out_err, grad_err, balanced, timed in results:  # fp32, O(1) values
        assert out_err < 1e-5 and grad_err < 1e-4, (out_err, grad_err)
        assert balanced and timed


# ---- end to end (torchrun) -------------------------------------------------------------------

_STEPS = 3
_SMALL = ["--training.steps", str(_STEPS), "--training.seq_len", "512", "--debug.deterministic", "--metrics.log_freq", "1"]
_LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
_CA = re.compile(r"ca step\s+(\d+)\s+imbalance ([0-9.]+) \(colocated\) -> ([0-9.]+) \((\w+)\)\s+bytes/layer fwd ([0-9.]+) MiB")


def _torchrun(nproc: int, *args: str, timeout: float = 240) -> str:
    cmd = [
        PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--local-ranks-filter", "0",
        "-m", "torchtitan_ext.train", "--job.config_file", "train_configs/debug_cpu.toml", *args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    return log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A seed checkpoint, then CAD on 2 processes and the 1-process reference from it."""
    d = tmp_path_factory.mktemp("titan")
    _torchrun(
        1, *_SMALL, "--job.dump_folder", str(d / "seed"), "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1",
    )  # fmt: skip
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(d / "seed/checkpoint/step-0"),
            "--checkpoint.interval", "100000", "--checkpoint.last_save_model_only"]  # fmt: skip
    two = _torchrun(2, *_SMALL, *load, "--job.dump_folder", str(d / "two"))
    # Reference: one process, the CA group's whole stream (2 x 512 tokens) as its one row,
    # block-causal attention over the same documents (distca with a group of 1).
    one = _torchrun(1, *_SMALL, *load, "--training.seq_len", "1024", "--job.dump_folder", str(d / "one"))
    return two, one


@pytest.mark.slow
def test_end_to_end_logs_ca_metrics(runs):
    two, _ = runs
    assert "Training completed" in two
    ca = _CA.findall(two)
    assert [int(s) for s, *_ in ca] == list(range(1, _STEPS + 1)), two[-4000:]
    for _, before, after, policy, fwd_mib in ca:
        assert policy == "distca" and float(after) <= float(before) + 1e-9 and float(fwd_mib) >= 0
    assert re.search(r"summary: 3 steps, [0-9.]+ s/step .*CA \(distca, group of 2\): imbalance", two)


@pytest.mark.slow
def test_loss_parity_with_one_process_reference(runs):
    two, one = runs
    l2 = [float(x) for _, x in _LOSS.findall(two)]
    l1 = [float(x) for _, x in _LOSS.findall(one)]
    assert len(l2) == len(l1) == _STEPS
    assert l2 == pytest.approx(l1, abs=2e-4), (l2, l1)
    assert l2[-1] < l2[0]  # it trains (real text)
