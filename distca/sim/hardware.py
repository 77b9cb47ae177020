"""Model shapes, the hardware profile and the per-GPU memory and linear-layer time models.

Every number the simulator charges for the hardware is a field of :class:`Hardware`; the module
constants below are the shipped H200 profile's values, each with its source. A profile can be
read from a JSON file (:func:`load_hardware`), a model shape too (:func:`load_arch`).

Units: seconds, bytes, FLOP/s, bytes/s. ``tp`` is the tensor-parallel degree: one CA rank is one
TP group, and per-GPU quantities are one GPU's share of its group.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distca import ModelShape

# ---- the shipped H200 profile (every number, with its source) ---------------------------

PEAK_BF16_FLOPS = 989e12
"""FLOP/s, dense bf16 tensor-core peak of one H100/H200 SXM GPU (NVIDIA datasheet; H200 has H100's
compute and more/faster HBM)."""

LINEAR_MFU = 0.5
"""Assumed fraction of peak the linear layers (QKV/O projections, MLP, LM head) reach, including
norms, RoPE and activations folded in. An assumption, typical of Megatron on Hopper at TP=8."""

IB_BYTES_PER_S = 50e9
"""Bytes/s per GPU per direction for the CA all-to-all: one 400 Gb/s InfiniBand NIC per GPU, the
bandwidth the paper's Appendix A assumes (50 GB/s)."""

NVLINK_BYTES_PER_S = 360e9
"""Bytes/s per GPU that NCCL all-gather / reduce-scatter reach inside an 8-GPU NVLink-4 node (the
link is 450 GB/s per direction; ~80% is an assumption). Used only for tensor-parallel traffic."""

TP = 8
"""Default tensor-parallel degree (``--tp``): one node of 8 GPUs, as in every experiment of the
paper. One CA rank is one TP group; attention heads are split over TP, so each GPU serves 1/TP of a
server's load and ships 1/TP of its bytes (each TP rank ships only its own heads)."""

COST_MODEL = "h200"
"""Stored attention cost model (``distca/data/cost_h200.json``): fitted by ``scripts/calibrate.py``
to forward + backward kernel times measured on one H200 (``docs/records/gpu_h200.md``). Backward =
``bwd_factor`` x forward."""

OP_OVERHEAD_S_EXCHANGE = (0.81e-3, 1.62e-3)
"""Seconds per ``core_attention`` call (forward, backward) beyond its kernels as measured on one H200
on 2026-11-29 (``docs/data/gpu_check_h200/op_check.json``: the op against the bare varlen kernel on
the same tasks, 16K tokens, 6 documents, Llama-3-8B heads, group of 1: forward 3.31 vs 2.50 ms,
forward + backward 11.68 vs 9.26 ms), with the runtime of that day, which gathered, packed, unpacked
and copied back every row even when no row moved. Kept as a sensitivity point:
``--op-overhead-scale 2`` charges it (it is exactly twice :data:`OP_OVERHEAD_S`)."""

OP_OVERHEAD_S = (0.405e-3, 0.81e-3)
"""Seconds per ``core_attention`` call (forward, backward) beyond its kernels: an estimate for the
in-place runtime, derived (no GPU measured it). On CPU, the same op-against-bare-kernel measurement
(``scripts/bench_attention.py --overhead``, ``docs/records/core_attention_cpu.md``) gave 9-15 % forward overhead
on whole and mixed layouts with the exchange runtime (group of 1, the GPU check's case) and at most
+4.5 % with the in-place runtime (every layout and run since, forward; forward + backward -1.5 to
+1.2 %): the op's own cost fell by a factor of at least 2 (9 % -> 4.5 %, the least favourable pair;
the central values, ~12 % -> ~2 %, say 5x). This takes the conservative factor 2 on the measured
GPU figure :data:`OP_OVERHEAD_S_EXCHANGE`, the backward twice the forward as measured. Charged per
layer and per call (two with ping-pong) to the policies that run on distca's op; the WLB baselines
run on their own CP and are charged none."""

A2A_BASE_LATENCY_S = 8.4e-6
"""Seconds of fixed cost per NCCL collective launch (NCCL's own tuning model, ``baseLat`` of the
Ring / Simple protocol in its ``src/graph/tuning.cc``). Nothing here measured it: the H200 check
has one GPU."""

NET_HOP_LATENCY_S = 6.6e-6
"""Seconds per network step of a collective over InfiniBand (the same tuning model's ``hwLat`` for
NET, Ring / Simple). An all-to-all sends to all peers at once (one step); a ring all-gather or
reduce-scatter over c ranks takes c - 1 steps."""

HBM_BYTES_PER_S = 4.8e12
"""Bytes/s of H200 HBM (NVIDIA datasheet: 4.8 TB/s). The runtime packs every exchanged row into one
send buffer and unpacks what it receives (``distca.exchange``): each byte sent or received is read
and written once on the compute stream, charged at this rate (an assumption: copies at peak)."""

HBM_BYTES = 141e9
"""Bytes of HBM per H200 GPU (NVIDIA datasheet: 141 GB)."""

GPUS_PER_NODE = 8
"""GPUs per NVLink domain: the largest TP degree whose collectives stay on NVLink."""

WLB_TOKEN_CAP = 2.0
"""``wlb_ideal``'s packing bound: a DP group of c ranks takes at most this x c x context tokens
(variable-length packing trades tokens for attention), and less where the memory estimate says so
(:func:`distca.sim.baselines.wlb_cap`)."""

# ---- the memory model's constants --------------------------------------------------------

ACT_BYTES_PER_TOKEN_HIDDEN = 34
"""Activation bytes per layer per token per hidden unit kept for the backward, over the TP degree:
34 s h / t with sequence parallelism and selective recomputation (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022, bf16; FlashAttention keeps no s^2
term). An estimate: the paper's runs may store less."""

ACT_FULL_BYTES_PER_TOKEN_HIDDEN = 2
"""Activation bytes per layer per token per hidden unit over the TP degree with full recomputation:
the layer's bf16 input only (2 s h / t, sequence-parallel), the same source."""

TP_COLLECTIVES_PER_LAYER = 4
"""Megatron sequence-parallel TP collectives per layer and direction: all-gather before QKV and
before the MLP, reduce-scatter after O and after the MLP."""


# ---- model shapes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """Dense transformer sizes: the linear-layer FLOPs, the memory estimate and the attention shape."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def shape(self) -> ModelShape:
        """The attention shape the planner and the bytes model use (bf16 activations)."""
        return ModelShape(self.heads, self.kv_heads, self.head_dim, 2)

    @property
    def layer_params(self) -> int:
        """Matmul parameters of one layer: Q and O (h x h), K and V (h x kv_heads*head_dim), MLP (3 x h x ffn)."""
        h = self.hidden
        return 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim + 3 * h * self.ffn

    @property
    def params(self) -> int:
        """Total matmul + embedding parameters: layers plus untied input embedding and LM head."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    @property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs per token per layer of the linear layers (2 per multiply-add)."""
        return 2.0 * self.layer_params

    @property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs per token of the LM head (the embedding lookup is free)."""
        return 2.0 * self.hidden * self.vocab

    def describe(self) -> str:
        return (f"{self.name}: {self.params / 1e9:.2f}B params, {self.layers} layers, hidden {self.hidden}, "
                f"ffn {self.ffn}, vocab {self.vocab}, {self.heads} heads / {self.kv_heads} KV heads")  # fmt: skip


ARCHS = {
    # Llama-3-8B (DeepSeek-R1-Distill-Llama-8B in the paper's scripts): 8.03e9 parameters.
    "llama3-8b": Arch("llama3-8b", 32, 4096, 14336, 128256, 32, 8, 128),
    # CodeLlama-34B as the paper uses it: 33.7e9 parameters (64 heads, 8 KV heads).
    "llama3-34b": Arch("llama3-34b", 48, 8192, 22016, 32000, 64, 8, 128),
}

_ARCH_INTS = ("layers", "hidden", "ffn", "vocab", "heads", "kv_heads", "head_dim")


def load_arch(name_or_path: str) -> Arch:
    """A shipped model (``llama3-8b``, ``llama3-34b``) or a JSON file of one: an object with the int
    fields ``layers``, ``hidden``, ``ffn``, ``vocab``, ``heads``, ``kv_heads``, optionally
    ``head_dim`` (default hidden / heads) and ``name`` (default the file's stem). Raises ValueError
    naming the rule broken."""
    if name_or_path in ARCHS:
        return ARCHS[name_or_path]
    p = Path(name_or_path)
    if p.suffix != ".json" and not p.exists():
        raise ValueError(f"--model {name_or_path!r}: not a shipped model {sorted(ARCHS)} nor a JSON file")
    d = _read_json_object(p, "--model")
    d.setdefault("name", p.stem)
    if "head_dim" not in d and isinstance(d.get("hidden"), int) and isinstance(d.get("heads"), int) and d["heads"] > 0:
        if d["hidden"] % d["heads"]:
            raise ValueError(f"--model {p}: hidden={d['hidden']} is not a multiple of heads={d['heads']}; "
                             "give head_dim")  # fmt: skip
        d["head_dim"] = d["hidden"] // d["heads"]
    unknown = sorted(set(d) - {"name", *_ARCH_INTS})
    missing = [k for k in _ARCH_INTS if k not in d]
    if unknown or missing:
        raise ValueError(f"--model {p}: fields must be {list(_ARCH_INTS)} (+ name); "
                         f"missing {missing}, unknown {unknown}")  # fmt: skip
    for k in _ARCH_INTS:
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--model {p}: {k} must be a positive integer, got {v!r}")
    if d["heads"] % d["kv_heads"]:
        raise ValueError(f"--model {p}: heads={d['heads']} must be a multiple of kv_heads={d['kv_heads']}")
    return Arch(str(d["name"]), *(d[k] for k in _ARCH_INTS))


# ---- the hardware profile ----------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """Every hardware number the model charges, plus the sensitivity knobs the CLI changes.

    The first seven fields are the CLI's knobs (``--mfu``, ``--ib-gbs``, ...); the rest describe the
    machine and default to the H200 profile's constants above.
    """

    linear_mfu: float = LINEAR_MFU
    ib_bytes_per_s: float = IB_BYTES_PER_S
    full_duplex: bool = True
    """True: a link sends and receives at full rate at once, comm = max(sent, received) / bandwidth.
    False: comm = (sent + received) / bandwidth."""
    latency_scale: float = 1.0
    """Multiplies ``a2a_base_latency_s`` and ``net_hop_latency_s`` (0: bandwidth only)."""
    wlb_token_cap: float = WLB_TOKEN_CAP
    """``wlb_ideal``'s packing bound before memory (:data:`WLB_TOKEN_CAP`)."""
    op_overhead_scale: float = 1.0
    """Multiplies ``op_overhead_s`` (0: the op costs only its kernels)."""
    hbm_bytes: float = HBM_BYTES
    """Bytes of GPU memory the recomputation choice (:func:`recompute_mode`) and WLB's cap must fit."""
    name: str = "h200"
    peak_flops: float = PEAK_BF16_FLOPS
    """FLOP/s per GPU of the linear layers before ``linear_mfu``."""
    nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S
    """Bytes/s per GPU of the TP all-gathers and reduce-scatters."""
    hbm_bytes_per_s: float = HBM_BYTES_PER_S
    """Bytes/s of the runtime's pack and unpack copies."""
    a2a_base_latency_s: float = A2A_BASE_LATENCY_S
    net_hop_latency_s: float = NET_HOP_LATENCY_S
    op_overhead_s: tuple[float, float] = OP_OVERHEAD_S
    """Seconds per ``core_attention`` call (forward, backward) beyond its kernels."""
    cost_model: str = COST_MODEL
    """The attention kernels' cost model: a stored name or a JSON path (``distca.load_cost_model``)."""
    gpus_per_node: int = GPUS_PER_NODE
    """GPUs per NVLink domain: the largest ``--tp``."""

    def settings(self) -> dict:
        """The knobs as a row's ``settings`` report them; a profile other than the shipped H200 adds
        ``hardware``: its name and the fields that differ."""
        out = {
            "mfu": self.linear_mfu, "ib_gbs": self.ib_bytes_per_s / 1e9, "full_duplex": self.full_duplex,
            "latency_scale": self.latency_scale, "wlb_token_cap": self.wlb_token_cap,
            "op_overhead_scale": self.op_overhead_scale, "hbm_gb": self.hbm_bytes / 1e9,
        }  # fmt: skip
        diff = {f: getattr(self, f) for f in _MACHINE_FIELDS if getattr(self, f) != getattr(H200, f)}
        if diff:
            diff = {k: list(v) if isinstance(v, tuple) else v for k, v in diff.items()}  # as JSON has it
            out["hardware"] = {"name": self.name, **diff}
        return out

    def op_overhead(self, pingpong: bool) -> tuple[float, float]:
        """``op_overhead_s`` per layer (fwd, bwd) for a policy on distca's op: one call, or one per
        nano-batch with ping-pong."""
        k = (2 if pingpong else 1) * self.op_overhead_scale
        return k * self.op_overhead_s[0], k * self.op_overhead_s[1]

    def a2a_latency_s(self) -> float:
        """Seconds per all-to-all call: launch plus one network step (every peer at once)."""
        return self.latency_scale * (self.a2a_base_latency_s + self.net_hop_latency_s)

    def ring_latency_s(self, ranks: int) -> float:
        """Seconds per ring all-gather or reduce-scatter over ``ranks`` ranks (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        return self.latency_scale * (self.a2a_base_latency_s + (ranks - 1) * self.net_hop_latency_s)



H200 = Hardware()
"""The shipped profile: H200 SXM nodes of 8 GPUs, one 400 Gb/s NIC per GPU."""

HARDWARE = {"h200": H200}

_MACHINE_FIELDS = ("name", "peak_flops", "nvlink_bytes_per_s", "hbm_bytes_per_s", "a2a_base_latency_s",
                   "net_hop_latency_s", "op_overhead_s", "cost_model", "gpus_per_node")  # fmt: skip


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped profile (``h200``) or a JSON file of one: an object whose keys are :class:`Hardware`
    fields (SI units: bytes, bytes/s, FLOP/s, seconds), each overriding the profile named by its
    optional ``base`` key (default ``h200``); ``name`` defaults to the file's stem. Raises ValueError
    naming the rule broken."""
    if name_or_path in HARDWARE:
        return HARDWARE[name_or_path]
    p = Path(name_or_path)
    if p.suffix != ".json" and not p.exists():
        raise ValueError(f"--hardware {name_or_path!r}: not a shipped profile {sorted(HARDWARE)} nor a JSON file")
    d = _read_json_object(p, "--hardware")
    base = d.pop("base", "h200")
    if base not in HARDWARE:
        raise ValueError(f"--hardware {p}: base must be one of {sorted(HARDWARE)}, got {base!r}")
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    if unknown := sorted(set(d) - set(fields)):
        raise ValueError(f"--hardware {p}: unknown fields {unknown}; known: {sorted(fields)} and base")
    d.setdefault("name", p.stem)
    for k, v in d.items():
        if k in ("name", "cost_model"):
            if not isinstance(v, str) or not v:
                raise ValueError(f"--hardware {p}: {k} must be a non-empty string, got {v!r}")
        elif k == "full_duplex":
            if not isinstance(v, bool):
                raise ValueError(f"--hardware {p}: full_duplex must be true or false, got {v!r}")
        elif k == "op_overhead_s":
            if not (isinstance(v, list) and len(v) == 2 and all(_number(x) and x >= 0 for x in v)):
                raise ValueError(f"--hardware {p}: op_overhead_s must be [forward s, backward s] >= 0, got {v!r}")
            d[k] = (float(v[0]), float(v[1]))
        elif k == "gpus_per_node":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--hardware {p}: gpus_per_node must be a positive integer, got {v!r}")
        else:
            nonneg = k in ("latency_scale", "op_overhead_scale", "a2a_base_latency_s", "net_hop_latency_s")
            if not _number(v) or v < 0 or (v == 0 and not nonneg):
                raise ValueError(f"--hardware {p}: {k} must be a number {'>= 0' if nonneg else '> 0'}, got {v!r}")
            d[k] = float(v)
    if d.get("linear_mfu", 0.5) > 1:
        raise ValueError(f"--hardware {p}: linear_mfu must be in (0, 1], got {d['linear_mfu']}")
    return dataclasses.replace(HARDWARE[base], **d)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _read_json_object(p: Path, arg: str) -> dict:
    if not p.is_file():
        raise ValueError(f"{arg} {p}: no such file")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{arg} {p}: cannot read it as JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{arg} {p}: must hold a JSON object, got {type(d).__name__}")
    return d


# ---- memory and linear-layer time --------------------------------------------------------


def memory_per_gpu(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, recompute: str | int = "selective",
                   hbm: float = HBM_BYTES, tp: int = TP, buffer_bytes: float = 0.0) -> dict:  # fmt: skip
    """Estimated peak bytes per GPU of one step: activations of ``in_flight`` micro-batches of
    ``tokens`` tokens per TP group over the stage's layers, plus model states with Megatron's
    distributed optimizer: bf16 parameters and gradients (4 bytes / parameter) sharded over TP x PP,
    fp32 master weights and Adam moments (12 bytes / parameter) also over DP, plus ``buffer_bytes``:
    one layer's communication buffers per GPU (transient, one layer at a time: distca's send and
    receive buffers, per-document CP's all-gathered K/V).

    ``recompute="selective"``: ``ACT_BYTES_PER_TOKEN_HIDDEN`` s h / t per layer kept. ``"full"``: only
    each layer's input (``ACT_FULL_BYTES_PER_TOKEN_HIDDEN`` s h / t) is kept, plus one layer's
    selective working set while it is recomputed. An int k (0 .. layers of the stage): k layers
    recomputed in full, the others selective (k = 0 is ``"selective"``, all layers ``"full"``).

    Returns ``activation_gib``, ``model_state_gib``, ``buffer_gib``, ``memory_gib`` and
    ``fits_memory`` (total <= ``hbm`` bytes).
    """
    stage = arch.layers // pp if arch.layers % pp == 0 else arch.layers / pp
    if recompute == "selective":
        k = 0
    elif recompute == "full":
        k = stage
    elif isinstance(recompute, (int, np.integer)) and not isinstance(recompute, bool) and 0 <= recompute <= stage:
        k = int(recompute)
    else:
        raise ValueError(f"recompute must be 'selective', 'full' or a layer count in [0, {stage}], got {recompute!r}")
    sh = tokens * arch.hidden / tp
    act = (ACT_BYTES_PER_TOKEN_HIDDEN * (stage - k) + ACT_FULL_BYTES_PER_TOKEN_HIDDEN * k) * sh * in_flight
    if k:
        act += ACT_BYTES_PER_TOKEN_HIDDEN * sh  # one layer's selective working set while it reruns
    states = arch.params * (4.0 / (tp * pp) + 12.0 / (tp * pp * dp))
    gib = float(1 << 30)
    total = act + states + buffer_bytes
    return {
        "activation_gib": act / gib,
        "model_state_gib": states / gib,
        "buffer_gib": buffer_bytes / gib,
        "memory_gib": total / gib,
        "fits_memory": bool(total <= hbm),
    }


def recompute_layers(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, hbm: float = HBM_BYTES,
                     tp: int = TP, buffer_bytes: float = 0.0) -> int:  # fmt: skip
    """The fewest layers of a stage (0 .. layers / pp) whose full recomputation makes ``tokens`` per
    rank fit in ``hbm`` bytes (:func:`memory_per_gpu` with an int ``recompute``); every layer when
    even that does not fit (the row then says ``fits_memory: false``). Each recomputed layer costs
    one more forward of that layer (:func:`distca.sim.step.step_time`)."""
    stage = arch.layers // pp
    for k in range(stage + 1):
        if memory_per_gpu(arch, tokens, dp, pp, in_flight, k, hbm, tp, buffer_bytes)["fits_memory"]:
            return k
    return stage


def rerun_share(recompute: str | float) -> float:
    """Share of layers whose forward reruns in the backward: ``"selective"`` 0, ``"full"`` 1, or a
    number in [0, 1] (recomputed layers / layers)."""
    if recompute == "selective":
        return 0.0
    if recompute == "full":
        return 1.0
    f = float(recompute)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"recompute must be 'selective', 'full' or a share in [0, 1], got {recompute!r}")
    return f


def recompute_mode(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, hbm: float = HBM_BYTES,
                   tp: int = TP) -> str:  # fmt: skip
    """The all-or-nothing choice: ``"selective"`` if ``tokens`` per rank fit with it, else ``"full"``
    (:func:`recompute_layers` is the per-layer choice the simulator charges)."""
    fits = memory_per_gpu(arch, tokens, dp, pp, in_flight, hbm=hbm, tp=tp)["fits_memory"]
    return "selective" if fits else "full"


def recompute_label(k: int, stage: int) -> str:
    """``"selective"`` (no layer recomputed), ``"full"`` (all) or ``"partial"``."""
    return "selective" if k == 0 else "full" if k >= stage else "partial"


def memory_fields(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, recompute: str | int | None = None,
                  hbm: float = HBM_BYTES, tp: int = TP, buffer_bytes: float = 0.0) -> dict:  # fmt: skip
    """:func:`memory_per_gpu` under ``recompute`` (default: the fewest layers that fit,
    :func:`recompute_layers`), with ``recompute`` (``selective``, ``partial`` or ``full``),
    ``recompute_layers`` (layers of the stage recomputed) and ``recompute_share`` (their share)."""
    stage = arch.layers // pp
    if recompute is None:
        recompute = recompute_layers(arch, tokens, dp, pp, in_flight, hbm, tp, buffer_bytes)
    k = 0 if recompute == "selective" else stage if recompute == "full" else int(recompute)
    return {**memory_per_gpu(arch, tokens, dp, pp, in_flight, k, hbm, tp, buffer_bytes),
            "recompute": recompute_label(k, stage), "recompute_layers": k, "recompute_share": k / stage}  # fmt: skip


def fit_tokens(arch: Arch, dp: int, pp: int = 1, in_flight: int = 1, recompute: str | int = "selective",
               hbm: float = HBM_BYTES, tp: int = TP, buffer_bytes: float = 0.0) -> float:  # fmt: skip
    """Tokens per rank and micro-batch at which :func:`memory_per_gpu` reaches ``hbm`` bytes."""
    m0 = memory_per_gpu(arch, 0, dp, pp, in_flight, recompute, tp=tp, buffer_bytes=buffer_bytes)
    m1 = memory_per_gpu(arch, 1, dp, pp, in_flight, recompute, tp=tp, buffer_bytes=buffer_bytes)
    gib = float(1 << 30)
    return (hbm - m0["memory_gib"] * gib) / ((m1["memory_gib"] - m0["memory_gib"]) * gib)


def linear_fwd_s(arch: Arch, tokens: int, hw: Hardware, tp: int = TP, nano_batches: int = 1) -> float:
    """Forward seconds of one layer's linear part for ``tokens`` tokens on one TP group (backward: 2x).

    ``nano_batches``: the tokens run as that many equal nano-batches (ping-pong), each with its own
    :data:`TP_COLLECTIVES_PER_LAYER` TP collectives on its rows (the paper's, and
    ``torchtitan_ext``'s, per-nano-batch all-gathers and reduce-scatters): the same bytes in
    ``nano_batches`` times as many calls. Each extra call pays NCCL's launch latency
    (``a2a_base_latency_s``); one call per collective is inside the assumed MFU."""
    lin_f = tokens * arch.layer_flops_per_token / (tp * hw.peak_flops * hw.linear_mfu)
    # TP collectives move (TP-1)/TP of the gathered activations per GPU; assumed overlapped with
    # the GEMMs (TransformerEngine tp-comm-overlap), so they cost time only when longer.
    tp_f = TP_COLLECTIVES_PER_LAYER * (tp - 1) / tp * tokens * arch.hidden * 2 / hw.nvlink_bytes_per_s
    if tp > 1 and nano_batches > 1:
        tp_f += TP_COLLECTIVES_PER_LAYER * (nano_batches - 1) * hw.latency_scale * hw.a2a_base_latency_s
    return max(lin_f, tp_f)


def head_fwd_s(arch: Arch, tokens: int, hw: Hardware, tp: int = TP) -> float:
    """Forward seconds of the LM head for ``tokens`` tokens on one TP group (backward: 2x)."""
    return tokens * arch.head_flops_per_token / (tp * hw.peak_flops * hw.linear_mfu)
