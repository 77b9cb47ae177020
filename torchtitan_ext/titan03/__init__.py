"""torchtitan 0.3.0 adapter: core attention disaggregation (distca) in torchtitan's llama3.

torchtitan 0.3 configures a run from Python config registries, so this package is one::

    torchrun --nproc_per_node 2 -m torchtitan_ext.titan03.train \\
        --module torchtitan_ext.titan03 --config llama3_debugmodel_ca --core_attention.policy greedy

Every ``[core_attention]`` key of the 0.2.2 adapter is a ``--core_attention.<key>`` flag here,
with the same meaning, default and validation (:mod:`torchtitan_ext.config`).
See docs/guides/torchtitan03.md.

Modules (imported on demand: ``_compat.apply()`` must run before torchtitan is first imported on
CPU). They import the version-free modules of the parent package and never its 0.2.2 ones:

- ``_compat``: the CPU start-up patches for torchtitan 0.3.0 (no CUDA, no triton);
- ``model``: the core-attention module, the RoPE that covers CA positions, the model conversion;
- ``data``: the CA data loader as a torchtitan 0.3 ``Configurable`` dataloader;
- ``pipeline``: the pipelining function (tick schedules through torchtitan's ``pipeline_llm``) and
  the step's micro-batches as torchtitan 0.3 draws them;
- ``validate``: ``CAValidator``, torchtitan's validator on the CA loader, every batch planned;
- ``trainer``: ``CoreAttentionTrainer`` and its ``Config`` (the ``core_attention`` section);
- ``config_registry``: the ``--config`` functions (``llama3_debugmodel_ca``);
- ``train``: the CPU launcher (patches, then ``torchtitan.train.main()``).

This package's import checks the installed torchtitan is 0.3.0 (the error names the 0.2.2
adapter's command otherwise); it imports no torchtitan itself.
"""

from torchtitan_ext._version import require_torchtitan

require_torchtitan("0.3.0", "torchtitan_ext.titan03 (the torchtitan 0.3.0 adapter)")

TORCHTITAN_VERSION = "0.3.0"
"""The torchtitan release this adapter is written against (``torchtitan==0.3.0``)."""
