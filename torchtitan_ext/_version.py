"""Which torchtitan is installed, and the check each adapter makes when it is imported.

Two adapters live in this package: the torchtitan 0.2.2 one (``torchtitan_ext.train``, TOML
configs) and the torchtitan 0.3.0 one (``torchtitan_ext.titan03``, Python config registries). A
venv holds one torchtitan, so importing the other adapter would fail deep inside torchtitan; this
check fails first and says which command fits the installed version. Reads package metadata only
(no torchtitan import).
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["COMMANDS", "installed_torchtitan", "require_torchtitan"]

COMMANDS = {
    "0.2.2": "torchrun --nproc_per_node 2 -m torchtitan_ext.train --job.config_file train_configs/debug_cpu.toml",
    "0.3.0": "torchrun --nproc_per_node 2 -m torchtitan_ext.titan03.train --module torchtitan_ext.titan03 "
    "--config llama3_debugmodel_ca",
}
"""Each adapter's launch command, keyed by the torchtitan version it is written against."""


def installed_torchtitan() -> str | None:
    """The installed torchtitan's version string, or None when it is not installed."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def require_torchtitan(want: str, adapter: str) -> None:
    """Raise ImportError unless torchtitan ``want`` is installed; the message names the adapter
    (and its command) that fits the installed version, when there is one."""
    got = installed_torchtitan()
    if got == want:
        return
    other = COMMANDS.get(got or "")
    hint = (
        f"; torchtitan {got} has its own adapter: {other}" if other
        else f"; supported versions: {', '.join(sorted(COMMANDS))}"
    )  # fmt: skip
    raise ImportError(
        f"{adapter} is written against torchtitan=={want}, but "
        f"{'torchtitan is not installed' if got is None else f'torchtitan=={got} is installed'}{hint}"
    )
