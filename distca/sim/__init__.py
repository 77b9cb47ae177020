"""Analytic step-time simulator: distca against its baselines on a model, a cluster and a workload.

``python -m distca.sim --help`` for the command line; ``docs/guides/simulator.md`` for the model.

Modules, one role each:

- :mod:`distca.sim.hardware`: model shapes (:class:`Arch`), the hardware profile (:class:`Hardware`),
  the memory and linear-layer time models;
- :mod:`distca.sim.workloads`: document-length pools (shipped or a user's file) and batch sampling;
- :mod:`distca.sim.step`: per-rank costs of a plan, the phases of a layer, the step time;
- :mod:`distca.sim.baselines`: the WLB baselines (``wlb_cp``, ``wlb_ideal``, packing);
- :mod:`distca.sim.sweep`: one 3D configuration's rows over every policy, speedups and intervals;
- :mod:`distca.sim.pipeline`: the ``--pp`` (4D) model;
- :mod:`distca.sim.paper`: the paper code's generators, packing and WLB-ideal, re-implemented;
- :mod:`distca.sim.paper_mode`: ``--mode paper``, the paper code's experiment on the 3D grid;
- :mod:`distca.sim.report`: tables and plots;
- :mod:`distca.sim.cli`: the command line.
"""

from distca.sim.hardware import ARCHS, HARDWARE, Arch, Hardware, load_arch, load_hardware
from distca.sim.sweep import POLICIES, Options, simulate_config
from distca.sim.workloads import Workload, load_workload

__all__ = [
    "ARCHS",
    "HARDWARE",
    "POLICIES",
    "Arch",
    "Hardware",
    "Options",
    "Workload",
    "load_arch",
    "load_hardware",
    "load_workload",
    "simulate_config",
]
