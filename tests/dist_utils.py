"""The tests' distributed launcher: ``distca._spawn.run`` (real gloo groups, file rendezvous, timeouts)."""

from distca._spawn import run as run_workers

__all__ = ["run_workers"]
