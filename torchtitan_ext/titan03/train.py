"""CPU launcher of the torchtitan 0.3.0 adapter::

    torchrun --nproc_per_node 2 -m torchtitan_ext.titan03.train \\
        --module torchtitan_ext.titan03 --config llama3_debugmodel_ca

It applies :mod:`torchtitan_ext.titan03._compat` (torchtitan binds its device type when first
imported) and then runs torchtitan's own ``torchtitan.train.main()``, which builds the
``CoreAttentionTrainer`` from the config. On a CUDA machine with triton the stock entry point
``-m torchtitan.train`` with the same arguments does the same.
"""

from __future__ import annotations

import os

from torchtitan_ext.titan03 import _compat


def run() -> None:
    _compat.apply()
    import torch
    from torchtitan.train import main

    if not torch.cuda.is_available():
        # torchrun exports TORCH_NCCL_ASYNC_ERROR_HANDLING and torchtitan overwrites it with a
        # warning; without CUDA there is no NCCL for it to configure.
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    main()


if __name__ == "__main__":
    run()
