"""torchtitan_ext: config validation, CPU start-up patches, the attention module, end-to-end training.

The slow tests launch ``torchrun -m torchtitan_ext.train`` (1, 2 and 4 processes, CPU/gloo) on the
debug model and check the CA metrics, and loss parity with a one-process reference that uses plain
block-causal SDPA (``tests/sdpa_reference_train.py``). The SAC tests check that selective activation
checkpointing saves the CA op's outputs instead of re-running it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import numpy as np
import pytest
import torch

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in this process

from torchtitan_ext.config import CoreAttention, validate  # noqa: E402

from dist_utils import run_workers  # noqa: E402

from _titan import (  # noqa: E402
    _CA, _COMMON, _SDPA_LAUNCHER, _STEPS, _WINDOW, PY, ROOT, _assert_resumes, _from_seed, _job, _losses, _torchrun,
    _validation, torchrun,
)


# ---- config ----------------------------------------------------------------------------------


def test_validate_defaults_and_degree():
    assert validate(CoreAttention(), dp_size=4) == 1  # off: CA degree 1
    assert validate(CoreAttention(enable=True), dp_size=4) == 4  # -1: all DP ranks
    assert validate(CoreAttention(enable=True, degree=2), dp_size=4) == 2
    # Pipeline parallelism: DP ranks per group (of every stage across stages, or of one stage).
    assert validate(CoreAttention(enable=True), dp_size=2, pp_degree=2) == 2
    assert validate(CoreAttention(enable=True, degree=1, across_stages=False), dp_size=2, pp_degree=2, pp_schedule="1F1B") == 1
    # Tick1F1B (the default), TickGPipe, ping-pong and TP all compose with a group across stages.
    for sched in ("Tick1F1B", "TickGPipe"):
        assert validate(CoreAttention(enable=True, pingpong=True), dp_size=2, pp_degree=2, pp_schedule=sched) == 2
        assert validate(CoreAttention(enable=True), dp_size=2, pp_degree=2, tp_degree=2, pp_schedule=sched) == 2


@pytest.mark.parametrize(
    "cfg, kwargs, match",
    [
        (CoreAttention(enable=True, degree=3), {"dp_size": 4}, r"core_attention.degree=3 must divide the data-parallel size 4 \(valid: -1 or one of \[1, 2, 4\]\)"),
        (CoreAttention(enable=True, degree=0), {"dp_size": 4}, r"core_attention.degree=0 must divide"),
        (CoreAttention(enable=True), {"dp_size": 2, "cp_degree": 2}, r"cannot be combined with parallelism.context_parallel_degree=2"),
        (CoreAttention(enable=True), {"dp_size": 2, "pp_degree": 2, "pp_schedule": "1F1B"}, r"core_attention.across_stages=true \(one CA group over the 2 pipeline stages\) needs .*pipeline_parallel_schedule = \"Tick1F1B\" \(or \"TickGPipe\"; got '1F1B'\), or core_attention.across_stages = false"),
        (CoreAttention(enable=True, mode="keep"), {"dp_size": 2, "pp_degree": 2}, r'core_attention.mode="keep" cannot be combined with core_attention.across_stages=true: .* set mode = "resend"'),
        (CoreAttention(enable=True), {"dp_size": 2, "pp_degree": 2, "pp_schedule": "Interleaved1F1B"}, r"cannot run under parallelism.pipeline_parallel_schedule='Interleaved1F1B'"),
        (CoreAttention(enable=True, across_stages=False), {"dp_size": 2, "pp_degree": 2, "pp_schedule": "ZBVZeroBubble"}, r"interleaved, zero-bubble and DualPipeV schedules are not supported"),
        (CoreAttention(enable=True), {"dp_size": 2, "pp_degree": 2, "ac_mode": "full"}, r'across_stages=true cannot be combined with activation_checkpoint.mode="full"'),
        (CoreAttention(enable=True, degree=1), {"dp_size": 2, "pp_degree": 2}, r"core_attention.degree=1 must then be -1 or the data-parallel size 2"),
        (CoreAttention(enable=True, pingpong=True), {"dp_size": 2, "tp_degree": 2, "seq_len": 66}, r"with parallelism.tensor_parallel_degree=2 needs training.seq_len divisible by nano_batches \* tensor_parallel_degree = 4, got seq_len=66"),
        (CoreAttention(policy="fastest"), {"dp_size": 2}, r"core_attention.policy='fastest' is unknown; choose one of \['distca', 'greedy', 'per_doc_cp', 'wlb_cp', 'colocated'\]"),
        (CoreAttention(mode="lazy"), {"dp_size": 2}, r"core_attention.mode='lazy' is unknown"),
        (CoreAttention(tolerance=1.5), {"dp_size": 2}, r"core_attention.tolerance=1.5 must be a number in \[0, 1\)"),
        (CoreAttention(min_shard=0), {"dp_size": 2}, r"core_attention.min_shard=0 must be an int >= 1"),
        (CoreAttention(capacity_mib=0), {"dp_size": 2}, r"core_attention.capacity_mib=0 must be -1 \(no bound\) or a number > 0"),
        (CoreAttention(pingpong=True, nano_batches=1), {"dp_size": 2}, r"core_attention.pingpong=true overlaps two nano-batches; got nano_batches=1"),
        (CoreAttention(nano_batches=3), {"dp_size": 2}, r"core_attention.nano_batches=3 must be -1 \(auto\), 1 or 2"),
        (CoreAttention(compare_to="/no/such/run"), {"dp_size": 2}, r"core_attention.compare_to='/no/such/run': cannot read a run summary at /no/such/run"),
    ],
)
def test_validate_errors(cfg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate(cfg, **kwargs)


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


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(enable="false"), r"core_attention.enable='false' must be true or false, got str \(write it unquoted"),
        (dict(pingpong=1), r"core_attention.pingpong=1 must be true or false, got int"),
        (dict(across_stages="yes"), r"core_attention.across_stages='yes' must be true or false"),
        (dict(degree=2.0), r"core_attention.degree=2.0 must be an integer, got float"),
        (dict(min_shard=True), r"core_attention.min_shard=True must be an integer, got bool"),
        (dict(tolerance="0.1"), r"core_attention.tolerance='0.1' must be a number, got str"),
        (dict(capacity_mib=None), r"core_attention.capacity_mib=None must be a number, got NoneType"),
        (dict(backend=3), r"core_attention.backend=3 must be a string, got int"),
        (dict(cost_model=None), r"core_attention.cost_model=None must be a string"),
    ],
)
def test_every_key_is_type_checked(bad, match):
    with pytest.raises(TypeError, match=match):
        validate(CoreAttention(**bad), dp_size=2)


def test_a_quoted_boolean_in_toml_is_rejected_at_start_up(tmp_path):
    from torchtitan.config import ConfigManager

    from torchtitan_ext.config import validate_job

    toml = tmp_path / "job.toml"
    toml.write_text('[job]\ncustom_config_module = "torchtitan_ext.config"\n[core_attention]\nenable = "false"\n')
    cfg = ConfigManager().parse_args([f"--job.config_file={toml}"])
    with pytest.raises(TypeError, match=r"core_attention.enable='false' must be true or false"):
        validate_job(cfg.core_attention, cfg, 2)


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
            "--core_attention.capacity_mib", "64",
            "--core_attention.placement", "balance",
        ]
    )  # fmt: skip
    ca = cfg.core_attention
    assert (ca.enable, ca.degree, ca.policy, ca.tolerance, ca.mode) == (True, 2, "greedy", 0.1, "keep")
    assert (ca.backend, ca.min_shard, ca.cost_model, ca.pingpong, ca.capacity_mib) == ("cpu", 64, "h200", False, 64)
    assert ca.placement == "balance"
    with pytest.raises(SystemExit):  # Literal choices are checked by the CLI parser
        ConfigManager().parse_args([f"--job.config_file={toml}", "--core_attention.policy", "fastest"])
    with pytest.raises(SystemExit):
        ConfigManager().parse_args([f"--job.config_file={toml}", "--core_attention.placement", "lpt"])


# ---- _compat ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not applied with CUDA")
def test_compat_applies_once_on_cpu():
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc
    import torchtitan.distributed.utils as du
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize
    import torchtitan.tools.utils as tu

    first = _compat.applied()
    assert set(_compat.PATCHES) - {"triton_stub"} <= first
    objs = (fc._get_gradient_divide_factors, du.set_pg_timeouts, torch.cpu.get_device_name)
    save_list = set(llama3_parallelize._op_sac_save_list)
    assert _compat.apply() == first  # idempotent: nothing re-wrapped
    assert (fc._get_gradient_divide_factors, du.set_pg_timeouts, torch.cpu.get_device_name) == objs
    assert llama3_parallelize._op_sac_save_list == save_list
    assert not hasattr(fc._get_gradient_divide_factors.__wrapped__, "__wrapped__")
    assert tu.device_type == "cpu" and tu.device_module is torch.cpu
    # Memory columns: this process's peak RSS (the interpreter alone holds far more than 50 MiB),
    # against physical RAM.
    import resource

    mem = torch.cpu.memory_stats()
    assert mem["reserved_bytes.all.peak"] == mem["active_bytes.all.peak"] > 50 << 20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= mem["reserved_bytes.all.peak"]
    assert torch.cpu.get_device_properties().total_memory > mem["reserved_bytes.all.peak"]
    # MFU: no peak on CPU (NaN, not an A100's 312e12); other devices keep torchtitan's table.
    assert np.isnan(tu.get_peak_flops("cpu"))
    assert tu.get_peak_flops("NVIDIA H100 PCIe") == tu.get_peak_flops.__wrapped__("NVIDIA H100 PCIe") == 756e12
    # gloo has no PREMUL_SUM: a divide factor of 1.0 (llama3's) must reduce with plain SUM on CPU.
    _, _, rs_op, ar_op = fc._get_gradient_divide_factors(None, None, torch.float32, "cpu", 1.0)
    assert rs_op == torch.distributed.ReduceOp.SUM and ar_op == torch.distributed.ReduceOp.SUM


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not applied with CUDA")
def test_cpu_mfu_is_never_a_number_above_100_percent(caplog):
    """The worst case of a CPU peak measured at start-up: taken while every core is busy (the
    other rank starting on the same cores), then beaten by the step's matmuls running alone
    (``make train`` printed ``mfu: 104.97%``). MFU as torchtitan computes it must then be at
    most 100 % or not reported, and the console must say so rather than print ``nan%``."""
    import logging
    import sys

    import torchtitan.tools.utils as tu

    busy = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True: a @ a"
    others = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(3.0)  # their imports done: they are multiplying now
        peak = tu.get_peak_flops("cpu")
    finally:
        for p in others:
            p.kill()
            p.wait()
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    mfu = 100 * (2 * 2048**3 / best) / peak  # what the model's matmuls reach alone, over the peak
    assert not mfu > 100.0, f"MFU {mfu:.1f}% (peak {peak:.3e} FLOP/s measured under load)"
    with caplog.at_level(logging.INFO):
        logging.getLogger().info(f"Peak FLOPS used for computing MFU: {peak:.3e}")
        logging.getLogger().info(f"step:  1  loss:  7.5  tps: 670  tflops: 0.05  mfu: {mfu:.2f}%")
    assert caplog.messages[-1].endswith("tflops: 0.05  mfu: n/a on CPU"), caplog.messages
    assert caplog.messages[-2].startswith("MFU is not reported on CPU"), caplog.messages


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_compat_without_cuda_only():
    """With CUDA (simulated) no CPU workaround is applied (the triton stub only if triton is
    missing); the SAC save-list entry is not a workaround and is applied everywhere."""
    code = (
        "import importlib.util, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from torchtitan_ext import _compat\n"
        "got = _compat.apply()\n"
        "want = {'sac_save_core_attention'} | (set() if importlib.util.find_spec('triton') else {'triton_stub'})\n"
        "assert set(got) == want, got\n"
        "import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc\n"
        "assert not hasattr(fc._get_gradient_divide_factors, '__wrapped__')\n"
        "assert not hasattr(torch.cpu, 'get_device_name')\n"
        "import torchtitan.models.llama3.infra.parallelize as p\n"
        "assert torch.ops.distca.core_attention_fwd.default in p._op_sac_save_list\n"
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
        "    assert 'apply() before importing torchtitan' in str(e), e\n"
        "    print('raised')\n"
    )
    if torch.cuda.is_available():
        pytest.skip("torchtitan binds 'cuda' legitimately here")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "raised" in r.stdout, r.stderr[-3000:]


# ---- the attention module (2 gloo processes) -------------------------------------------------


def _module_worker(rank, world, T, cu):
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext.layers import CoreAttentionModule
    from torchtitan_ext.planning import CAPlanner

    torch.manual_seed(0)
    Hq, Hkv, D = 4, 2, 16
    q_all = torch.randn(1, Hq, world * T, D, dtype=torch.float32)
    k_all = torch.randn(1, Hkv, world * T, D, dtype=torch.float32)
    v_all = torch.randn(1, Hkv, world * T, D, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ca_outer", "ca"))
    cfg = CoreAttention(enable=True)
    planner = CAPlanner(cfg=cfg, mesh=mesh, degree=world, rank=rank)
    step = planner.bind(planner.plan([torch.tensor(cu)]))  # what the model gets as attention_masks
    sl = slice(rank * T, (rank + 1) * T)
    q, k, v = (x[:, :, sl].clone().requires_grad_() for x in (q_all, k_all, v_all))
    out = CoreAttentionModule(cfg)(*(x[0].transpose(0, 1) for x in (q, k, v)), step)  # [T, H, D]
    out = out.transpose(0, 1)[None]  # torchtitan layout (1, H, T, D)
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
    stats = step.stats
    return (
        (out - ref[:, :, sl]).abs().max().item(),
        max((a.grad[:, :, sl] - b.grad).abs().max().item() for a, b in ((qa, q), (ka, k), (va, v))),
        stats[0].imbalance <= stats[0].imbalance_colocated + 1e-12,
        [kind for kind, *_ in step.attn_events] == ["fwd", "bwd"] and step.attention_seconds() is not None,
    )


@pytest.mark.slow
def test_attention_module_matches_document_sdpa():
    T, cu = 96, [0, 150, 160, 192]  # a document crossing the rank boundary, GQA 4:2
    results = run_workers(_module_worker, 2, T, cu, timeout=120)
    for out_err, grad_err, balanced, timed in results:  # fp32, O(1) values
        assert out_err < 1e-5 and grad_err < 1e-4, (out_err, grad_err)
        assert balanced and timed


# ---- end to end (torchrun) -------------------------------------------------------------------
#
# One CA group of W = 1024 tokens per step (2 x 512, or 1 x 1024 in the reference),
# synthetic_pretrain documents (~35 per window, a new layout every step), fp32, deterministic,
# all runs from one seed checkpoint. Each run is a module-scoped fixture shared by the tests.

@pytest.fixture(scope="module")
def sdpa(titan_dir, seed_ckpt):
    """Independent reference: one process, the whole 1024-token row, torch SDPA with an explicit
    boolean block-causal mask from the step's cu_seqlens (tests/sdpa_reference_train.py; no distca
    planner or kernels), RoPE by the loader's in-document positions."""
    return _from_seed(
        1, titan_dir, seed_ckpt, "sdpa", "--core_attention.no-enable", "--model.converters", "sdpa_reference",
        *_validation(1), launcher=_SDPA_LAUNCHER,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compiled(titan_dir, seed_ckpt):
    """CAD on 2 processes with --compile.enable (every TransformerBlock and the loss compiled)."""
    return _from_seed(2, titan_dir, seed_ckpt, "compiled", "--compile.enable")


@pytest.mark.slow
def test_end_to_end_logs_ca_metrics(two):
    log, tb, folder = two
    ca = _CA.findall(log)
    assert [int(s) for s, *_ in ca] == list(range(1, _STEPS + 1)), log[-4000:]
    for _, before, after, policy, fwd_mib in ca:
        # distca never plans worse than colocated; when it cannot do better it moves nothing.
        assert policy == "distca" and float(after) <= float(before)
        assert float(fwd_mib) > 0 or after == before, (before, after, fwd_mib)
    # The closing summary quotes the per-step lines it summarises, and the PNG is written.
    summary = log.split("summary: ")[-1]
    assert summary.startswith(f"{_STEPS} steps, CA group of 2 ranks, policy distca"), summary[:2000]
    m = re.search(r"imbalance\s+([0-9.]+) mean, ([0-9.]+) worst without CAD -> ([0-9.]+) mean, ([0-9.]+) worst", summary)
    before, after = (np.array([float(c[i]) for c in ca]) for i in (1, 2))
    got = [float(x) for x in m.groups()]
    assert got == pytest.approx([before.mean(), before.max(), after.mean(), after.max()], abs=1.5e-3), (got, ca)
    # The cost model's figure is labelled a model, never a speedup; with no baseline run there is no
    # measured one. The run's ca_summary.json (for a later run's compare_to) holds the printed speed.
    m = re.search(r"model       slowest rank's attention ([0-9.]+) s/step without CAD -> ([0-9.]+) s/step with it", summary)
    assert m and float(m[2]) <= float(m[1]) and "faster" not in summary, summary[:2000]
    assert "measured    no baseline" in summary and "speedup" not in summary, summary[:2000]
    assert re.search(r"balance     [0-9.]+ max/mean of the ranks' measured attention", summary), summary[:2000]
    step_s = float(re.search(r"speed\s+([0-9.]+) s/step", summary)[1])
    saved = json.loads((folder / "ca_summary.json").read_text())
    assert saved["policy"] == "distca" and saved["steps"] == _STEPS and saved["step_s"] == pytest.approx(step_s, abs=6e-4)
    assert saved["batches"]["seq_len"] > 0 and saved["batches"]["dataset"], saved
    assert f"tensorboard {folder}/tb/" in summary and f"plot        {folder}/ca_summary.png" in summary
    assert (folder / "ca_summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_summary_speedup_is_measured_against_a_run_on_the_same_batches(two, titan_dir, seed_ckpt):
    """A colocated run on the same batches as ``two`` (same seed checkpoint, data and steps), told
    ``compare_to`` that run's dump folder: its summary quotes both measured step times and their ratio."""
    log, _, folder = _from_seed(
        2, titan_dir, seed_ckpt, "colocated", "--core_attention.policy", "colocated",
        "--core_attention.compare_to", str(two[2]),
    )  # fmt: skip
    summary = log.split("summary: ")[-1]
    mine = float(re.search(r"speed\s+([0-9.]+) s/step", summary)[1])
    theirs = json.loads((two[2] / "ca_summary.json").read_text())["step_s"]
    m = re.search(r"measured    colocated ([0-9.]+) s/step vs distca ([0-9.]+) s/step on the same batches "
                  r"\((.+)\): speedup ([0-9.]+)x", summary)  # fmt: skip
    assert m, summary[:3000]
    assert float(m[1]) == mine and float(m[2]) == pytest.approx(theirs, abs=6e-4) and m[3] == f"{two[2]}/ca_summary.json"
    assert float(m[4]) == pytest.approx(theirs / mine, abs=2e-3)
    assert json.loads((folder / "ca_summary.json").read_text())["batches"] == json.loads((two[2] / "ca_summary.json").read_text())["batches"]


@pytest.mark.slow
def test_console_shows_each_line_once_without_noise(two):
    """What the launcher silences at its source stays silent, the memory column is this machine's,
    and MFU is not reported on CPU (the console is torchrun's rank-0 filter, as in make train)."""
    log = two[0]
    assert log.count("INFO - step:  1  loss:") == 1 and log.count("ca step  1 ") == 1
    for noise in ("Error running lspci", "Peak flops undefined", "safetensors.index.json not found", "set_vital",
                  "may not have complete support", "Set timeout is now only supported", "will be overridden to"):  # fmt: skip
        assert noise not in log, noise
    mem = [float(x) for x in re.findall(r"memory:\s+([0-9.-]+)GiB", log)]
    assert len(mem) >= _STEPS and min(mem) > 0.05, mem  # + validation
    # No MFU on CPU (no peak bounds it): every step line says so, none prints a percentage.
    assert log.count("mfu: n/a on CPU") == _STEPS and not re.search(r"mfu: [0-9.na]+%", log), log[-3000:]
    assert "MFU is not reported on CPU" in log


@pytest.mark.slow
def test_ca_metrics_in_tensorboard(two):
    """The per-step CA numbers go to the same TensorBoard run as torchtitan's loss and tokens/s."""
    _, tb, _ = two
    steps = list(range(1, _STEPS + 1))
    for tag in ("loss_metrics/global_avg_loss", "throughput(tps)", "ca/imbalance_colocated", "ca/imbalance",
                "ca/fwd_MiB_per_layer", "ca/bwd_MiB_per_layer", "ca/plan_ms", "ca/docs", "ca/attn_fwd_s",
                "ca/attn_bwd_s"):  # fmt: skip
        assert sorted(tb.get(tag, {})) == steps, (tag, sorted(tb))
    for s in steps:
        # distca never plans worse than colocated; many documents per window; resend's backward
        # moves more than its forward (or both are 0); the attention clock marks were recorded.
        assert tb["ca/imbalance"][s] <= tb["ca/imbalance_colocated"][s] and tb["ca/docs"][s] > 5
        assert tb["ca/bwd_MiB_per_layer"][s] > tb["ca/fwd_MiB_per_layer"][s] or tb["ca/bwd_MiB_per_layer"][s] == 0
        assert tb["ca/attn_fwd_s"][s] > 0 and tb["ca/attn_bwd_s"][s] > 0


@pytest.mark.slow
def test_loss_parity_with_sdpa_reference(sdpa, two, compiled):
    """CAD on 2 processes (eager and compiled) = one process with plain block-causal SDPA over the
    same 1024 tokens, 10 fp32 steps. The reference shares no distca code
    (tests/sdpa_reference_train.py), only the data loader and torchtitan's llama3. A CA group of 4
    in the trainer is checked by tests/test_pipeline.py (pp 2 x dp 2, one group of 4 ranks, equal
    to gradient accumulation) and tests/test_tensor_parallel.py (4 processes); the op on 4 ranks by
    tests/test_core_attention.py (a separate 4-process run here cost ~30 s of CI time).

    Measured: losses within ~1e-7 relative, grad norms within ~3e-5. The grad norm is the sharper
    check here: with a plain causal mask (attention across documents) the reference's grad norms
    move by ~5e-2 and its losses by only ~2.5e-4 (random tokens keep the loss near ln 2048)."""
    ref = _losses(sdpa)
    assert len(ref) == _STEPS and "ca/docs" not in sdpa[1]  # CAD really off in the reference
    assert min(two[1]["ca/docs"].values()) > 5  # many documents per window, a new layout each step
    for run in (two, compiled):
        assert _losses(run) == pytest.approx(ref, rel=1e-4), (_losses(run), ref)
        gn, gn_ref = (list(r[1]["grad_norm"].values()) for r in (run, sdpa))
        assert gn == pytest.approx(gn_ref, rel=1e-3), (gn, gn_ref)


@pytest.mark.slow
def test_validation_plans_its_batches_and_matches_sdpa(sdpa, two):
    """torchtitan's validator with CAD on (2 processes): each validation batch is planned like a
    training batch (a batch without its plan raises) and the validation losses equal the
    block-causal SDPA reference's on the same windows (attention across documents would move
    them by ~2.5e-4 relative, see the parity test above)."""
    ca, ref = (run[1]["validation_metrics/loss"] for run in (two, sdpa))
    assert sorted(ca) == sorted(ref) == [1, 5, 10]
    for s in ca:
        assert ca[s] == pytest.approx(ref[s], rel=2e-5), (s, ca[s], ref[s])


@pytest.fixture(scope="module")
def placed(titan_dir, seed_ckpt):
    """``two`` with ``--core_attention.placement balance``: each step's documents placed before planning."""
    return _from_seed(2, titan_dir, seed_ckpt, "placed", "--core_attention.placement", "balance", *_validation(2))


@pytest.mark.slow
def test_placement_trains_as_the_stream_order(placed, two):
    """Placement only moves whole documents between the ranks of a step: losses and grad norms equal
    the unplaced run's (up to fp32 summation order), every step. The logged imbalance before
    placement is what the planner sees without it (``two``'s colocated imbalance), after it what
    the planner sees with it: the loader models what the planner models (cost model and shape)."""
    log, tb, _ = placed
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "validation_metrics/loss"):
        got, want = ([r[1][tag][s] for s in sorted(r[1][tag])] for r in (placed, two))
        assert len(got) == len(want) >= 3 and got == pytest.approx(want, rel=1e-5), (tag, got, want)
    steps = list(range(1, _STEPS + 1))
    before, after = tb["ca/placement_imbalance_before"], tb["ca/placement_imbalance_after"]
    assert sorted(before) == sorted(after) == steps and "ca/placement_imbalance_before" not in two[1]
    for s in steps:
        assert after[s] <= before[s]
        assert before[s] == pytest.approx(two[1]["ca/imbalance_colocated"][s], rel=1e-5), s
        assert after[s] == pytest.approx(tb["ca/imbalance_colocated"][s], rel=1e-5), s
    assert sum(after[s] < before[s] - 1e-3 for s in steps) >= _STEPS // 2, (before, after)
    assert len(re.findall(r"ca step\s+\d+ .* placement [0-9.]+ -> [0-9.]+", log)) == _STEPS, log[-3000:]


# Op-level SAC in the trainer (the CA op in the save list, losses equal to no checkpointing, no
# exchange in the recompute) is tests/test_titan_ac_profiling.py's: one run with and one without
# it there, whose plans move rows (a separate 10-step run here cost another launch).


@pytest.mark.slow
def test_compile_matches_eager_without_recompiles(compiled, two):
    log, _, _ = compiled
    assert _losses(compiled) == pytest.approx(_losses(two), rel=1e-4), (_losses(compiled), _losses(two))
    # A new plan (and document layout) every step; it reaches the compiled blocks as a tensor handle.
    m = re.search(r"torch.compile: (\d+) graphs in step 1, (\d+) more after", log)
    assert m and int(m[1]) >= 1 and int(m[2]) == 0, log[-4000:]


def _faulty_run(folder, env: dict[str, str], *args: str) -> tuple[str, float]:
    """2 processes of ``tests/fault_train.py`` (every rank's lines prefixed ``[default<r>]:``) that
    must fail; returns the log and the wall seconds."""
    rc, log, wall = torchrun(
        2, folder, "--training.seq_len", str(_WINDOW // 2), *_COMMON, *args, launcher=(str(ROOT / "tests/fault_train.py"),),
        flags=("--tee", "3"), env=env, timeout=300, check=False,
    )  # fmt: skip
    assert rc != 0 and "Training completed" not in log, log[-4000:]
    return log, wall


@pytest.mark.slow
def test_a_killed_rank_ends_every_rank_and_the_run_resumes_exactly(titan_dir, seed_ckpt, two):
    """Rank 1 is killed (SIGKILL) inside step 7's forward, while rank 0 is in the same step's CA
    exchanges: every rank exits with an error (torchrun stops the survivors; the process-group
    timeout, --comm.train_timeout_seconds, bounds any wait), and resuming from the last checkpoint
    (step 5: model, optimizer, lr, step, data loader) reproduces the uninterrupted run's steps 6-10."""
    folder = titan_dir / "killed"
    log, wall = _faulty_run(
        folder, {"DISTCA_TEST_KILL_STEP": "7"}, "--checkpoint.enable", "--checkpoint.initial_load_path",
        str(seed_ckpt), "--checkpoint.interval", "5", "--comm.train_timeout_seconds", "60",
    )  # fmt: skip
    assert "Signals.SIGKILL" in log or "SIGKILL" in log, log[-4000:]
    assert wall < 200  # ended well before the subprocess timeout: nothing hung
    launch = lambda folder, *flags: _torchrun(2, folder, *flags)  # noqa: E731
    _assert_resumes(launch, titan_dir / "killed_resumed", folder / "checkpoint/step-5", two, _STEPS)


@pytest.mark.slow
def test_a_rejected_call_on_one_rank_raises_on_every_rank_before_the_optimizer_step(tmp_path):
    """Rank 1 passes a bad mode to one core-attention call of step 3 (its peer's calls are fine).
    No layer call agrees across ranks, so the call runs there on placeholder rows and every other
    call of the step goes on; the step boundary (``distca.check``, before gradient clipping and
    the optimizer) raises the error on both ranks: steps 1 and 2 updated the parameters, step 3
    did not, and nothing waited for the process-group timeout."""
    log, wall = _faulty_run(
        tmp_path, {"DISTCA_TEST_BAD_CALL_STEP": "3"}, "--training.steps", "4", "--comm.train_timeout_seconds", "120"
    )
    assert wall < 120, "ended by a timeout, not by the check"
    for rank in (0, 1):
        steps = [int(m) for m in re.findall(rf"\[default{rank}\]:optimizer step (\d+)", log)]
        assert steps == [1, 2], (rank, steps, log[-4000:])
    mine = "mode must be 'resend' or 'keep', got 'fast'"
    assert re.search(rf"\[default1\]:.*ValueError: core_attention rejected a call on this rank: {re.escape(mine)}", log), log[-4000:]
    assert re.search(r"\[default0\]:.*ValueError: another rank of the CA group \(size 2\) rejected its input: rank 1 says", log), log[-4000:]


# ---- selective activation checkpointing ------------------------------------------------------


def _sac_worker(rank, world):
    """Gradients and op/collective counts of one forward+backward: without checkpointing, under SAC
    with the CA op saved (MUST_SAVE; eager and compiled) or recomputed (eager, the control)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    import distca
    from distca import kernels
    from dist_utils import count_collectives

    T, H, D = 64, 2, 8
    # per_doc_cp splits both documents over both ranks: the op exchanges rows every call.
    # Its spec is agreed here, so no call runs an agreement: every all-to-all counted is the exchange's.
    dp = distca.prepare(torch.tensor([0, 100, 2 * T]), policy="per_doc_cp", spec=distca.CallSpec(H, H, D, torch.float32))
    torch.manual_seed(0)
    x, w = torch.randn(T, H * D), torch.randn(H * D, 3 * H * D) / 4
    counts = {"kernel_fwd": 0}
    kernel = kernels.varlen_attn_forward

    def counting_kernel(*args, **kwargs):
        counts["kernel_fwd"] += 1
        return kernel(*args, **kwargs)

    # Both are looked up as module attributes at call time (kernels.varlen_attn_forward in the op,
    # the collectives in torch.distributed), so these count real executions only, compiled too.
    kernels.varlen_attn_forward = counting_kernel

    def f(x, handle):
        q, k, v = (x @ w).view(T, 3, H, D).unbind(1)
        return distca.core_attention(q, k, v, None, plan=handle).square().sum()

    def policy(save_ca, ctx, func, *args, **kwargs):
        if func == torch.ops.distca.core_attention_fwd.default and save_ca:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def sac(save_ca):
        ctx_fn = partial(create_selective_checkpoint_contexts, partial(policy, save_ca))
        return lambda x, handle: checkpoint(f, x, handle, use_reentrant=False, context_fn=ctx_fn)

    results = {}
    for name, fn, compiled in (
        ("none", f, False), ("save", sac(True), False), ("recompute", sac(False), False),
        ("compiled_save", sac(True), True),
    ):  # fmt: skip
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="inductor", fullgraph=True)
            fn(x.clone().requires_grad_(), dp.handle).backward()  # compile outside the counts
        counts.update(kernel_fwd=0)
        xg = x.clone().requires_grad_()
        with count_collectives() as calls:
            fn(xg, dp.handle).backward()
        n = dict(counts, all_to_all=calls.count("all_to_all_single"), collectives=len(calls))
        results[name] = (xg.grad.numpy(), n)  # numpy: tensors do not outlive the worker
    return results


@pytest.mark.slow
# Inductor's CPU code path calls torch.jit.script_method, deprecated in torch 2.13.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_sac_saves_ca_op_outputs_and_skips_it_in_recompute():
    """SAC with ``distca::core_attention_fwd`` MUST_SAVE (torchtitan's op save list, see ``_compat``):
    the same gradients as no checkpointing, and the recompute runs neither the op's kernel nor its
    all-to-alls, eager and under ``torch.compile``. The op returns ``out``/``lse``; while it only wrote
    preallocated buffers, a saved op had no outputs to cache and the recompute left them uninitialized."""
    for res in run_workers(_sac_worker, 2, timeout=240):
        (g_none, n_none), (g_rec, n_rec) = res["none"], res["recompute"]
        assert n_none["kernel_fwd"] == 1 and n_none["all_to_all"] > 0, n_none  # rows really move
        assert n_none["collectives"] == n_none["all_to_all"], n_none  # spec agreed: the exchange's calls only
        # The control: recomputing the op runs its kernel and forward all-to-alls again.
        assert n_rec["kernel_fwd"] == 2 and n_rec["all_to_all"] > n_none["all_to_all"], n_rec
        for name in ("save", "compiled_save"):
            g, n = res[name]
            assert n == n_none, (name, n, n_none)  # forward once, no collective in the recompute
        for name in ("save", "recompute"):  # the same ops on the same inputs: bitwise equal
            assert np.isfinite(res[name][0]).all() and np.array_equal(res[name][0], g_none), name
        np.testing.assert_allclose(res["compiled_save"][0], g_none, rtol=1e-5, atol=1e-6)


def test_ca_op_in_llama3_sac_save_list():
    """``_compat.apply()`` puts the CA op into torchtitan's llama3 op-level SAC save list."""
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize

    assert "sac_save_core_attention" in _compat.applied()
    assert torch.ops.distca.core_attention_fwd.default in llama3_parallelize._op_sac_save_list


# ---- capacity ---------------------------------------------------------------------------------


def _bind_worker(rank, world):
    """CAPlanner.bind before and after the trainer hands it the agreed call shape."""
    from torch.distributed.device_mesh import init_device_mesh

    import distca
    from torchtitan_ext.planning import CAPlanner

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ca_outer", "ca"))
    pl = CAPlanner(cfg=CoreAttention(enable=True), mesh=mesh, degree=world, rank=rank)
    q, k, v = (torch.randn(64, h, 8) for h in (4, 2, 2))
    cu = [torch.tensor([0, 40, 128])]
    first = pl.bind(pl.plan(cu)).plans[0]  # no shape yet: agreed at its first call
    before = (first.verify, first.spec)
    distca.core_attention(q, k, v, None, plan=first)
    pl.spec = first.spec  # what the trainer does after the first step's check
    seen = [before, (first.verify, first.spec)]
    for mode in ("resend", "keep"):  # the config's mode may change between steps (bench_train does)
        pl.cfg.mode = mode
        dp = pl.bind(pl.plan(cu)).plans[0]  # agreed here, shape included: no collective in the call
        distca.core_attention(q, k, v, None, plan=dp, mode=mode).sum()
        distca.check(dp)  # raises if the call was rejected
        seen.append((dp.verify, dp.spec))
    return seen


@pytest.mark.slow
def test_bind_agrees_the_learned_call_shape_with_the_current_mode():
    import distca

    for seen in run_workers(_bind_worker, 2, timeout=60):
        spec = distca.CallSpec(4, 2, 8, torch.float32, "resend")
        assert seen == [("first_use", None), ("first_use", spec), ("now", spec),
                        ("now", distca.CallSpec(4, 2, 8, torch.float32, "keep"))], seen  # fmt: skip


def _capacity_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from distca import MODEL_SHAPES, load_cost_model
    import distca
    from torchtitan_ext.planning import CAPlanner

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ca_outer", "ca"))
    out = []
    for mib in (-1.0, 16.0, 1e-4):
        pl = CAPlanner(
            cfg=CoreAttention(enable=True, capacity_mib=mib), mesh=mesh, degree=world, rank=rank,
            shape=MODEL_SHAPES["debug"], cost_model=load_cost_model("cpu"),
        )  # fmt: skip
        planned = pl.plan([torch.tensor([0, 2000, 2048])])
        step = pl.bind(planned)
        try:  # a planning error on any rank is raised on every rank, at the plan's first use
            distca.core_attention(*(torch.zeros(1024, h, 16) for h in (16, 16, 16)), None, plan=step.plans[0])
            out.append(step.plans[0].plan.capacity_bytes)
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.slow
def test_capacity_mib_reaches_the_planner_and_a_too_small_one_fails_everywhere():
    for none, cap, err in run_workers(_capacity_worker, 2, timeout=60):
        assert none is None and cap == 16 << 20
        assert "capacity_bytes=104 is below what rank" in err or "another rank" in err, err


def test_auto_cost_model_prices_bytes_on_gpus():
    from distca import load_cost_model
    from torchtitan_ext.config import GPU_COST_MODEL, CoreAttention, cost_model_name

    assert cost_model_name(CoreAttention(), cuda=False) == "cpu"
    assert cost_model_name(CoreAttention(), cuda=True) == GPU_COST_MODEL
    assert cost_model_name(CoreAttention(cost_model="h200"), cuda=True) == "h200"
    assert load_cost_model(GPU_COST_MODEL).has_network  # the GPU default prices bytes


def test_a_plan_kept_colocated_is_named_in_the_step_line():
    """``distca`` keeps a layout home when no move pays for its bytes (small nano-batch or sub-tick
    layouts under the CPU cost model): the step line says so instead of showing an unexplained
    imbalance above the tolerance."""
    from distca import MODEL_SHAPES, load_cost_model
    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.planning import CAPlanner, StepPlan
    from torchtitan_ext.report import step_line, step_row

    pl = CAPlanner(
        cfg=CoreAttention(enable=True), mesh=None, degree=2, rank=0,
        shape=MODEL_SHAPES["debug"], cost_model=load_cost_model("cpu"),
    )  # fmt: skip
    # Step 4 of the pp 2 Tick1F1B ping-pong debug run: one nano-batch's sub-tick layout, 1.244 colocated.
    kept = pl.plan([torch.tensor([0, 1024, 1562, 1625, 2048])]).stats[0]
    moved = pl.plan([torch.tensor([0, 2048])]).stats[0]  # one causal document over both ranks
    assert kept.kept_colocated and kept.fwd_bytes == 0
    assert kept.imbalance == kept.imbalance_colocated > 1.2
    assert not moved.kept_colocated and moved.fwd_bytes > 0 and moved.imbalance < 1.05 < moved.imbalance_colocated
    line = step_line(4, step_row([StepPlan((), (kept, moved))], [], 1), "distca", 6, 1)
    assert "(distca; 1 of 2 plans kept colocated: no move pays for its bytes under the cost model)" in line, line
    assert "(distca)" in step_line(4, step_row([StepPlan((), (moved,))], [], 1), "distca", 6, 1)
