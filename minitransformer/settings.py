"""The environment switches, read once, here, when this module is first imported.

=========================== ==============================================================
MINITRANSFORMER_DEVICE      ``cpu`` (default) or ``cuda``: the command lines' default device
MINITRANSFORMER_FUSED       ``0`` runs CuPy arrays through the reference ops instead of the
                            fused CUDA kernels (default ``1``)
MINITRANSFORMER_FLAT_ADAM   ``1`` / ``0``: Adam keeps parameters, gradients and moments in
                            four flat buffers, or one array each (default: flat on a GPU)
MINITRANSFORMER_MALLOC      ``0`` leaves glibc's allocator settings alone (see _malloc.py)
=========================== ==============================================================

A value other than those is not used (the default stands) and is listed in
``SETTINGS.problems``: train.py and translate.py refuse to start with one, naming the variable
and its values, and ``python -m minitransformer.doctor`` shows them.

Code reads ``SETTINGS.<name>``, never ``os.environ``. A test that needs another value sets
the attribute (``monkeypatch.setattr(SETTINGS, "fused", False)``); a subprocess reads its own
environment. This module imports nothing heavy: process.py uses it before NumPy loads.
"""
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass
class Settings:
    device: str = "cpu"
    fused: bool = True
    flat_adam: Optional[bool] = None  # None: decided by the parameters' device
    malloc: bool = True
    problems: list = field(default_factory=list)  # values given that are not used: why


def read(environ: Mapping[str, str] = os.environ) -> Settings:
    """The settings ``environ`` asks for; a value that is none of a switch's keeps the
    default and is described in ``problems``."""
    out = Settings()

    def switch(name, values):
        text = environ.get(name, "").strip()
        if text and text.lower() not in values:
            out.problems.append(f"{name}={text!r} is not one of {', '.join(values)} (or "
                                "unset); set one of those, or unset it")
            return None
        return values.get(text.lower()) if text else None

    device = switch("MINITRANSFORMER_DEVICE", {"cpu": "cpu", "cuda": "cuda"})
    fused = switch("MINITRANSFORMER_FUSED", {"1": True, "0": False})
    flat = switch("MINITRANSFORMER_FLAT_ADAM", {"1": True, "0": False})
    malloc = switch("MINITRANSFORMER_MALLOC", {"1": True, "0": False})
    out.device = device or "cpu"
    out.fused = True if fused is None else fused
    out.flat_adam = flat
    out.malloc = True if malloc is None else malloc
    return out


def refuse_problems(settings: Optional[Settings] = None) -> None:
    """For the command lines: exit with status 2 and one line per switch whose value is not
    used (``problems``), before any work."""
    import sys
    problems = (settings or SETTINGS).problems
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


SETTINGS = read()
