"""The key of a bundle: everything that invalidates compiled code, hashed.

torch, Triton and CUDA versions, the device's name, the policy's compile settings (global, rules, shapes and
optimizer sections; not its name or the cache section), the model's structure (every module's qualified name
and class, every parameter's and buffer's name, shape, dtype and device) and the user's salt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import metadata
from typing import Any, Dict, Optional

import torch
from torch import nn

from compile_trainer.cache.bundle import SUFFIX
from compile_trainer.schema import CompilePolicy

KEY_FORMAT = 1
NOT_COMPILE_SETTINGS = ("name", "cache")  # policy fields that change no compiled code


def triton_version() -> Optional[str]:
    for distribution in ("triton", "pytorch-triton"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def model_structure(model: nn.Module) -> str:
    """A digest of the module tree and its tensors' names, shapes, dtypes and devices (not their values)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}\n".encode())
    for kind, tensors in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, tensor in tensors:
            digest.update(f"{kind} {name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}\n".encode())
    return digest.hexdigest()


def compile_settings(policy: CompilePolicy) -> Dict[str, Any]:
    settings = dataclasses.asdict(policy)
    for name in NOT_COMPILE_SETTINGS:
        settings.pop(name)
    return settings


def key_fields(model: nn.Module, policy: CompilePolicy, device: torch.device) -> Dict[str, Any]:
    """What the key is computed from; a bundle's manifest keeps them, so a mismatch can be named."""
    return {
        "format": KEY_FORMAT,
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "device": device_name(device),
        "compile_settings": compile_settings(policy),
        "model": f"{type(model).__qualname__} {model_structure(model)}",
        "salt": policy.cache.salt,
    }


def cache_key(fields: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def bundle_name(key: str) -> str:
    return f"{key}{SUFFIX}"


def mismatch(expected: Dict[str, Any], found: Dict[str, Any]) -> str:
    """The fields that differ between two sets of key fields, in words."""
    differing = [name for name in expected if expected.get(name) != found.get(name)]
    shown = [
        f"{name} {found.get(name)!r} (this run: {expected.get(name)!r})"
        for name in differing
        if name != "compile_settings"
    ]
    if "compile_settings" in differing:
        shown.append("the compile settings")
    return ", ".join(shown) or "its key"
