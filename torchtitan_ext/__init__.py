"""torchtitan extension: core attention disaggregation (distca) in torchtitan's llama3.

Two adapters: this package's modules for torchtitan 0.2.2 (TOML configs, ``-m torchtitan_ext.train``)
and the subpackage ``titan03`` for torchtitan 0.3.0 (Python config registries,
``-m torchtitan_ext.titan03.train --module torchtitan_ext.titan03 --config ...``). Each refuses the
other torchtitan at import (``_version``); both reuse the version-free modules below.

Modules (imported on demand; this package imports nothing at import time, because
``_compat.apply()`` must run before torchtitan is first imported). Imports between them go one
way only, leaves first.

Version-free (no torchtitan import at module level; reusable by another torchtitan's adapter):

- ``ticks``: the pipeline tick arithmetic (which micro-batch each stage holds per sub-tick);
- ``clock``: the clock marks around core attention calls;
- ``report``: the closing summary and the run's plot;
- ``config``: the ``[core_attention]`` job-config section (``custom_config_module``);
- ``data``: CA-group-aware packed data loading and the shipped tokenizer;
- ``planning``: the step's plans (``CAPlanner``, ``StepPlan``), made in the planning thread;
- ``pipeline``: the tick-synchronous pipeline schedules, on torch's pipelining;
- ``ca_mesh``: the ``"ca"`` mesh dimension (CA groups), carved from torchtitan's world mesh (the
  ``ParallelDims`` attributes it reads are the same in 0.2.2 and 0.3.0);
- ``_version``: the installed torchtitan and each adapter's check of it;
- ``_cpu``: the CPU start-up patches both torchtitans need (each adapter's ``_compat`` applies them).
- ``compile_cache``: a compile cache per rank (with ``--compile.enable``: inductor's cache mixes up TP groups).

Written against torchtitan 0.2.2:

- ``_compat``: the CPU start-up patches for torchtitan 0.2.2 (no CUDA, no triton);
- ``layers``: what a converted llama3 layer runs (``CoreAttentionModule``, the nano-batch block);
- ``converter``: the ``"core_attention"`` model converter (``custom_import``);
- ``validate``: torchtitan's validator on the CA loader;
- ``train``: the launcher and its TrainSpec hooks,
  ``torchrun ... -m torchtitan_ext.train --job.config_file ...``.

See docs/guides/torchtitan.md (0.2.2) and docs/guides/torchtitan03.md (0.3.0); tests/test_titan_imports.py checks the one-way imports and the boundary.
"""
