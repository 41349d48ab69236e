"""The environment switches, read once, here, when this module is first imported.

=========================== ==============================================================
MINITRANSFORMER_DEVICE      ``cpu`` (default) or ``cuda``: the command lines' default device
MINITRANSFORMER_FUSED       ``0`` runs CuPy arrays through the reference ops instead of the
                            fused CUDA kernels (default ``1``)
MINITRANSFORMER_FLAT_ADAM   ``1`` / ``0``: Adam keeps parameters, gradients and moments in
                            four flat buffers, or one array each (default: flat on a GPU)
MINITRANSFORMER_MALLOC      ``0`` leaves glibc's allocator settings alone (see _malloc.py)
=========================== ==============================================================

Code reads ``SETTINGS.<name>``, never ``os.environ``. A test that needs another value sets
the attribute (``monkeypatch.setattr(SETTINGS, "fused", False)``); a subprocess reads its own
environment. This module imports nothing heavy: process.py uses it before NumPy loads.
"""
import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass
class Settings:
    device: str = "cpu"
    fused: bool = True
    flat_adam: Optional[bool] = None  # None: decided by the parameters' device
    malloc: bool = True


def read(environ: Mapping[str, str] = os.environ) -> Settings:
    """The settings ``environ`` asks for (unknown values of the 0/1 switches count as unset)."""
    flat = environ.get("MINITRANSFORMER_FLAT_ADAM", "")
    return Settings(device=environ.get("MINITRANSFORMER_DEVICE", "cpu").lower(),
                    fused=environ.get("MINITRANSFORMER_FUSED", "1") != "0",
                    flat_adam={"1": True, "0": False}.get(flat),
                    malloc=environ.get("MINITRANSFORMER_MALLOC", "1") != "0")


SETTINGS = read()
