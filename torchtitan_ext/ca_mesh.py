"""The ``"ca"`` mesh dimension: which ranks form a CA group.

The data-parallel (batch) ranks are cut into groups of ``core_attention.degree``
consecutive batch ranks (``world_mesh`` unflattened into ``("ca_outer", "ca")``, or
``("ca_outer", "ca", "ca_tp")`` with tensor parallelism); each group shares one token
stream. With ``core_attention.across_stages`` a group spans the pipeline stages.
"""

__all__ = ["CA_DIMS", "CA_TP_DIM", "build_ca_mesh"]

CA_DIMS = ("ca_outer", "ca")
CA_TP_DIM = "ca_tp"
"""The innermost dim of the CA mesh with tensor parallelism: torchtitan's TP ranks."""


def build_ca_mesh(parallel_dims, degree: int, across_stages: bool = False):
    """Unflatten torchtitan's 1-D world mesh into ("ca_outer", "ca"[, "ca_tp"]) with "ca" of
    ``degree`` ranks, times the pipeline stages with ``across_stages``.

    torchtitan 0.2.2's ``ParallelDims`` has a fixed set of dimensions and no hook
    for another one, so the CA dimension is carved from its world mesh the same
    way torchtitan carves its own (``DeviceMesh._unflatten``). torchtitan lays the
    world out as ("pp", "batch", "cp", "tp"), TP innermost: world rank
    ``(s * dp + b) * tp + t`` is stage ``s``, batch rank ``b``, TP rank ``t`` (cp = 1,
    checked by :func:`torchtitan_ext.config.validate`). Without TP the mesh is
    ``(W // degree, degree)`` and CA group ``g`` is ranks ``[g*degree, (g+1)*degree)``:
    ``degree`` consecutive batch ranks of one stage. With TP it is
    ``(W // (degree * tp), degree, tp)`` named ("ca_outer", "ca", "ca_tp"): the "ca" group
    of a rank is the ``degree`` consecutive batch ranks ``[g*degree, (g+1)*degree)`` of its
    block that hold the same TP rank (the same attention heads), e.g. dp 2 x tp 2, degree 2:
    {0, 2} and {1, 3}. With ``across_stages`` (``degree`` = all ``dp`` batch ranks) the "ca"
    dim is every (stage, batch rank) pair, stage-major: CA rank ``s * dp + b``.
    """
    if getattr(parallel_dims, "cp", 1) > 1:
        raise ValueError(f"the CA mesh needs context_parallel_degree = 1, got cp={parallel_dims.cp}")
    tp = getattr(parallel_dims, "tp", 1)
    pp = getattr(parallel_dims, "pp", 1)
    world = parallel_dims.world_mesh
    W = world.size()
    if across_stages and pp > 1:
        if degree * pp * tp != W:
            raise ValueError(
                f"a CA group across the {pp} pipeline stages needs core_attention.degree = all data-parallel "
                f"ranks ({W // (pp * tp)}), got {degree}"
            )
        degree *= pp
    if W % (degree * tp):
        raise ValueError(f"world size {W} is not a multiple of core_attention degree {degree} x TP degree {tp}")
    outer = W // (degree * tp)
    override = {"ca_outer": "fake"} if outer == 1 else {}
    if tp == 1:
        return world._unflatten(0, (outer, degree), CA_DIMS, backend_override=override)
    return world._unflatten(0, (outer, degree, tp), (*CA_DIMS, CA_TP_DIM), backend_override=override)


def _dp_size(parallel_dims) -> int:
    return parallel_dims.dp_replicate * parallel_dims.dp_shard
