"""The torchtitan 0.3 adapter's configuration: the debug registry parses, every ``[core_attention]``
key of the 0.2.2 adapter is a ``--core_attention.<key>`` flag with the same default, and a bad value
stops at start-up naming it. In-process (torchtitan's ConfigManager, no training)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch

from _titan03 import LANE, REGISTRY, ROOT
from torchtitan_ext.config import CoreAttention

pytestmark = [LANE, pytest.mark.titan03]


@pytest.fixture(autouse=True)
def _cpu_patches():
    """The launcher's CPU patches, before any test imports torchtitan (it binds its device type then)."""
    from torchtitan_ext.titan03 import _compat

    _compat.apply()


def _parse(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args([*REGISTRY, *args])


def test_registry_parses_with_core_attention_overrides():
    """The cheapest end-to-end check: torchtitan's own parser loads the registry function and
    applies ``--section.key`` overrides, ours and torchtitan's."""
    from torchtitan_ext.titan03.model import CARoPE, CoreAttentionModule
    from torchtitan_ext.titan03.trainer import CoreAttentionTrainer

    cfg = _parse("--core_attention.policy", "greedy", "--core_attention.tolerance", "0.1", "--training.steps", "3")
    assert type(cfg) is CoreAttentionTrainer.Config
    assert cfg.core_attention == CoreAttention(enable=True, policy="greedy", tolerance=0.1)
    assert cfg.training.steps == 3 and cfg.training.disable_cuda_graphs
    # Parsing converts nothing: the trainer does, and only with core_attention.enable.
    attn = cfg.model_spec.model.layers[0].attention
    assert not isinstance(attn.inner_attention, CoreAttentionModule.Config) and not isinstance(attn.rope, CARoPE.Config)
    off = _parse("--core_attention.no-enable")
    assert off.core_attention.enable is False


def _flag_value(f: dataclasses.Field) -> tuple[list[str], object]:
    """Command-line words that set field ``f`` to a non-default value, and that value."""
    default = f.default
    if isinstance(default, bool):
        return ([f"--core_attention.{'no-' if default else ''}{f.name}"], not default)
    alternatives = {"degree": 2, "policy": "per_doc_cp", "tolerance": 0.2, "mode": "keep", "backend": "torch",
                    "min_shard": 64, "nano_batches": 1, "capacity_mib": 4.0, "cost_model": "cpu",
                    "placement": "balance", "compare_to": ""}  # fmt: skip
    value = alternatives[f.name]
    return ([f"--core_attention.{f.name}", str(value)], value)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(CoreAttention)])
def test_every_core_attention_key_is_a_flag_with_the_0_2_2_default(name):
    """Each key of the 0.2.2 section, set on the command line, reaches the parsed config; the
    registry's defaults are the section's (CAD on aside). Parsed with CAD off where the key's other
    value needs what this adapter does not support yet (nano-batches)."""
    f = next(f for f in dataclasses.fields(CoreAttention) if f.name == name)
    assert getattr(_parse().core_attention, name) == (True if name == "enable" else f.default)
    if name == "compare_to":  # a path to a previous run's summary: read at start-up, none here
        return
    words, value = _flag_value(f)
    if name != "enable":
        words.append("--core_attention.no-enable")
    got = _parse(*words).core_attention
    assert getattr(got, name) == value, (words, got)


def _parse_error(capsys, monkeypatch, *args: str) -> str:
    """What the parser prints when ``args`` is refused (tyro turns a config's ValueError into a usage
    error, exit code 2), boxes and line wraps removed."""
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as e:
        _parse(*args)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.replace("│", " ").split())


@pytest.mark.parametrize(
    "args, match",
    [
        (["--core_attention.tolerance", "2"], r"core_attention\.tolerance=2\.0 must be a number in \[0, 1\)"),
        (["--core_attention.min_shard", "0"], r"core_attention\.min_shard=0 must be an int >= 1"),
        (["--core_attention.nano_batches", "3"], r"core_attention\.nano_batches=3 must be -1 \(auto\), 1 or 2"),
        (["--parallelism.context_parallel_degree", "2"],
         r"core_attention\.enable=true cannot be combined with parallelism\.context_parallel_degree=2"),
        (["--training.no-disable_cuda_graphs"], r"core_attention\.enable=true needs --training\.disable_cuda_graphs"),
        (["--parallelism.pipeline_parallel_degree", "2"],  # the 0.2.2 rule first, as in the 0.2.2 adapter
         r"core_attention\.across_stages=true \(one CA group over the 2 pipeline stages\) needs"),
        (["--parallelism.tensor_parallel_degree", "2", "--core_attention.pingpong", "--training.seq_len", "1022"],
         r"core_attention\.nano_batches=-1 \(pingpong=true, resolved to 2 nano-batches\) with "
         r"parallelism\.tensor_parallel_degree=2 needs training\.seq_len divisible by nano_batches \* "
         r"tensor_parallel_degree = 4, got seq_len=1022"),  # the 0.2.2 rule
        (["--core_attention.mode", "keep", "--core_attention.no-across_stages", "activation-checkpoint:selective"],
         r'core_attention\.mode="keep" cannot be combined with activation_checkpoint=selective'),
        (["activation-checkpoint:full"],
         r"activation-checkpoint:full is not supported by the torchtitan 0\.3 adapter yet .*; use activation-checkpoint:selective"),
        (["--core_attention.pingpong", "--training.seq_len", "511"],
         r"core_attention\.nano_batches=2 needs --training\.seq_len divisible by it, got 511"),
    ],
)  # fmt: skip
def test_a_bad_value_stops_at_start_up_naming_the_flag(args, match, capsys, monkeypatch):
    """torchtitan_ext.config.validate's rules (and this adapter's), checked as the command line is
    parsed, before any process group or model exists."""
    assert re.search(match, _parse_error(capsys, monkeypatch, *args))


def test_a_value_outside_a_choice_is_rejected_by_the_parser_naming_the_flag():
    """``policy`` is a Literal: tyro itself refuses an unknown one, before our validation."""
    code = (
        "from torchtitan_ext.titan03 import _compat; _compat.apply()\n"
        "from torchtitan.config import ConfigManager\n"
        f"ConfigManager().parse_args({list(REGISTRY)!r} + ['--core_attention.policy', 'fastest'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    # tyro spells the flag with dashes in its message (--core-attention.policy); both spellings parse.
    assert "--core_attention.policy" in r.stderr.replace("-", "_").replace("__", "--") and "fastest" in r.stderr, r.stderr


def test_each_adapter_refuses_the_other_torchtitan_naming_its_command():
    """Under torchtitan 0.3.0 the 0.2.2 adapter's import fails and names this adapter's command."""
    r = subprocess.run([sys.executable, "-c", "import torchtitan_ext.train"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0
    assert "torchtitan_ext.train (the torchtitan 0.2.2 adapter) is written against torchtitan==0.2.2" in r.stderr
    assert "-m torchtitan_ext.titan03.train --module torchtitan_ext.titan03 --config llama3_debugmodel_ca" in r.stderr
    from torchtitan_ext._version import require_torchtitan

    with pytest.raises(ImportError, match=r"torchtitan==0\.3\.0 is installed; torchtitan 0\.3\.0 has its own adapter"):
        require_torchtitan("0.2.2", "x")


def test_torchtitans_config_printer_loads_the_registry():
    """``python -m torchtitan.config.manager`` (torchtitan's own parse-and-print) finds the registry
    without our launcher: the registry applies the CPU patches itself on import."""
    r = subprocess.run(
        [sys.executable, "-m", "torchtitan.config.manager", *REGISTRY, "--core_attention.policy", "greedy"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def test_carope_cache_spans_the_ca_window_through_torchtitans_seq_len_reset():
    """torchtitan resets every RoPE's max_seq_len to training.seq_len with dataclasses.replace; the
    span survives it, and the cache (and its bounds) cover span * max_seq_len positions."""
    from torchtitan.models.common.rope import ComplexRoPE

    from torchtitan_ext.titan03.model import CARoPE

    cfg = CARoPE.Config(dim=16, max_seq_len=131072, theta=500000.0, span=1)
    cfg.span = 4
    cfg = dataclasses.replace(cfg, max_seq_len=64)  # what Decoder.Config.update_from_config does
    rope = cfg.build()
    assert type(rope) is CARoPE and rope.config.max_seq_len == 256 and rope.cache.shape[0] == 256
    plain = ComplexRoPE.Config(dim=16, max_seq_len=256, theta=500000.0).build()
    assert torch.equal(rope.cache, plain.cache)  # the same table, only longer than seq_len
    with pytest.raises(ValueError, match=r"CARoPE span=0 must be >= 1"):
        dataclasses.replace(cfg, span=0).build()


def test_convert_swaps_attention_and_rope_configs_only():
    """The conversion the trainer applies with core_attention.enable: every layer's inner attention
    and RoPE config, nothing else; the model still passes torchtitan's Module protocol check."""
    from torchtitan.models.llama3 import model_registry

    from torchtitan_ext.titan03.model import CARoPE, CoreAttentionModule, convert

    spec = model_registry("debugmodel", attn_backend="varlen")
    before = spec.model.to_dict()
    assert convert(spec.model, CoreAttention(backend="torch")) == 6
    for layer in spec.model.layers:
        assert layer.attention.inner_attention == CoreAttentionModule.Config(backend="torch")
        assert isinstance(layer.attention.rope, CARoPE.Config) and layer.attention.rope.span == 1
    after = spec.model.to_dict()
    for i in range(6):
        for key in ("inner_attention", "rope"):
            before["layers"][i]["attention"].pop(key), after["layers"][i]["attention"].pop(key)
    assert before == after
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    with pytest.raises(RuntimeError, match=r"core attention needs the micro-batch's StepPlan as attention_masks"):
        q = torch.zeros(1, 4, 16, 16)
        model.layers["0"].attention.inner_attention(q, q, q, attention_masks=None)


def test_ca_selective_ac_saves_torchtitans_ops_and_core_attention():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from torchtitan_ext.titan03.model import CASelectiveAC

    ours, theirs = CASelectiveAC.Config().build().get_save_ops(), SelectiveAC.Config().build().get_save_ops()
    assert theirs < ours and torch.ops.distca.core_attention_fwd.default in ours - theirs
