"""torchtitan 0.2.2 extension: core attention disaggregation (distca) in torchtitan's llama3.

Modules (imported on demand; this package imports nothing at import time, because
``_compat.apply()`` must run before torchtitan is first imported):

- ``_compat``: the CPU start-up patches for torchtitan 0.2.2 (no CUDA, no triton);
- ``config``: the ``[core_attention]`` job-config section (``custom_config_module``);
- ``converter``: the ``"core_attention"`` model converter (``custom_import``);
- ``planning``: the step's plans (``CAPlanner``, ``StepPlan``), made in the planning thread;
- ``ca_mesh``: the ``"ca"`` mesh dimension (CA groups);
- ``layers``: what a converted layer runs (``CoreAttentionModule``, the nano-batch block);
- ``data``: CA-group-aware packed data loading and the shipped tokenizer;
- ``train``: the launcher, ``torchrun ... -m torchtitan_ext.train --job.config_file ...``.

See docs/torchtitan.md.
"""
