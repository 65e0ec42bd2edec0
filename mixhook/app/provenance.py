"""What a run's numbers depend on besides its config, recorded in ``summary.json``: package versions,
Python, the CPU (model, the vector instructions torch's kernels pick from, intra-op threads) or GPU, and
a hash of the data split (:func:`digest`). Two runs of the same config whose figures differ can then be
told apart by these fields instead of by guessing."""

from __future__ import annotations

import hashlib
import platform
import sys
from importlib import metadata

import numpy as np
import torch

PACKAGES = ("mixhook", "torch", "torchvision", "numpy", "scikit-learn", "hydra-core", "omegaconf", "timm")
# The CPU flags that decide which vector kernels torch and numpy run (and so their rounding).
_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
          "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")  # fmt: skip


def digest(*arrays) -> str:
    """A SHA-256 (first 16 hex digits) of the arrays' shapes, dtypes and bytes, in order: tensors or
    numpy arrays. The same split of the same data gives the same digest on every machine."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _cpu() -> dict:
    model, flags = None, []
    try:
        with open("/proc/cpuinfo") as f:  # Linux; elsewhere platform's word for it
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    present = set(value.split())
                    flags = [flag for flag in _FLAGS if flag in present]
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": flags,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def environment(device: torch.device) -> dict:
    """Python, the packages' versions (``None``: not installed), the CPU and, on CUDA, the GPU."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "cpu": _cpu(),
    }
    if device.type == "cuda":
        env["gpu"] = {
            "name": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }
    return env
