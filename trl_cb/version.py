"""trl_cb's version, in a module of its own so that any layer may report it (the rollout server's `/version`)
without importing the package root, which imports every layer."""

__all__ = ["__version__"]

__version__ = "0.1.0"
