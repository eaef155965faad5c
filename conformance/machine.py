"""Where a run ran: the machine, a device's name and driver, and the installed versions of this
project and the frameworks. Read by the reports and by the executors that run columns elsewhere
(a Ray node says its own), so it sits on the lowest floor of conformance/."""

from __future__ import annotations

import contextlib
import importlib.util
import platform
import re
import socket
import subprocess
from importlib import metadata
from dataclasses import dataclass
from pathlib import Path

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def machine() -> dict[str, str]:
    """What a report says about the machine that ran it."""
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version()}


def driver_version(text: str) -> str | None:
    """The NVIDIA kernel module's version from /proc/driver/nvidia/version."""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def device_facts(device: str) -> dict[str, str | None]:
    """The device's name and driver as the machine reports them."""
    if device == "cpu":
        return {"device": "cpu", "name": platform.processor() or platform.machine(), "driver": None}
    name = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.strip().splitlines()
        name = listed[0].strip() if listed else None
    if name is None:
        with contextlib.suppress(ImportError, RuntimeError, AssertionError):
            import torch

            name = torch.cuda.get_device_name(0)
    return {"device": device, "name": name or "unknown CUDA device",
            "driver": driver_version(NVIDIA_DRIVER.read_text()) if NVIDIA_DRIVER.exists() else None}


_FRAMEWORKS = ("numpy", "safetensors", "torch", "jax", "jaxlib", "flax", "onnx", "onnxscript", "onnxruntime-gpu",
               "matplotlib")


def framework_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (no framework is imported); onnxruntime-gpu's
    from the module that would be imported where its metadata is absent (a GPU machine's staged
    copy: its package folder alone, beside the image's CPU onnxruntime)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _FRAMEWORKS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = module_version("onnxruntime") if name == "onnxruntime-gpu" else None
    return versions


def module_version(module: str) -> str | None:
    """The `__version__ = "..."` line of the package that `import module` would load, unimported."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        return None
    found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", Path(spec.origin).read_text(), flags=re.MULTILINE)
    return found.group(1) if found else None


def project_version() -> str | None:
    try:
        return metadata.version("transformer-rosetta")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return None


CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Int8Path:
    """How this CPU multiplies u8 activations by s8 weights in the int8 kernels onnxruntime (MLAS)
    and CTranslate2 (oneDNN) pick for it (SPEC §15.2): `saturating` where VPMADDUBSW adds each pair
    of adjacent products into an int16 first, clamped to [−32768, 32767]; exact where VNNI or AMX
    sums every product in int32; None where neither is known (another architecture)."""

    name: str  # AVX-512 VNNI
    instruction: str  # VPDPBUSD
    saturating: bool | None

    def describe(self) -> str:
        if self.saturating is None:
            return f"{self.name}: no int8 path of this project's knowledge"
        sums = ("each pair of u8·s8 products summed into an int16 and clamped to [−32768, 32767]" if self.saturating
                else "every u8·s8 product summed in int32, exactly")
        return f"{self.name} ({self.instruction}: {sums})"


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo (or of `text` in its format); empty where the
    file is absent (not Linux)."""
    if text is None:
        text = CPUINFO.read_text() if CPUINFO.exists() else ""
    found = re.search(r"^flags\s*:(.*)$", text, flags=re.MULTILINE)
    return frozenset(found.group(1).split()) if found else frozenset()


def int8_path(flags: frozenset[str] | None = None) -> Int8Path:
    """The int8 product path an x86 CPU with these flags gets, in the order the libraries prefer
    them: AMX, AVX-512 VNNI, AVX-VNNI, then AVX-512 (BW) or AVX2, whose VPMADDUBSW saturates."""
    flags = cpu_flags() if flags is None else flags
    if {"amx_int8", "amx_tile"} <= flags:
        return Int8Path("AMX", "TDPBUSD", False)
    if {"avx512_vnni", "avx512bw"} <= flags:
        return Int8Path("AVX-512 VNNI", "VPDPBUSD", False)
    if "avx_vnni" in flags:
        return Int8Path("AVX-VNNI", "VPDPBUSD", False)
    if "avx512bw" in flags:
        return Int8Path("AVX-512 without VNNI", "VPMADDUBSW", True)
    if "avx2" in flags:
        return Int8Path("AVX2 without VNNI", "VPMADDUBSW", True)
    return Int8Path("no AVX2", "", None)
