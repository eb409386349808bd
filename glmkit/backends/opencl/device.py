"""Finding OpenCL devices: the platforms' devices whose compiler works, described by `DeviceInfo`.

`cl` is pyopencl, or None when it cannot be imported: the rest of the OpenCL backend imports it from here, so a
broken install only means "no OpenCL device" and never takes the NumPy path down with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    import pyopencl as cl
except Exception:  # noqa: BLE001 - any import failure means "no OpenCL"
    cl = None


def available() -> bool:
    """Whether pyopencl could be imported (devices may still be missing: `list_devices`)."""
    return cl is not None


@dataclass(frozen=True)
class DeviceInfo:
    """One OpenCL device as `list_devices` found it (sizes in bytes)."""

    platform_index: int
    device_index: int
    platform: str
    name: str
    driver: str
    kind: str  # "gpu", "cpu", "accelerator"
    global_mem: int
    max_alloc: int
    compute_units: int
    unified: bool  # host-unified memory: weights can be used in place from the mapping

    @property
    def spec(self) -> str:
        return f"opencl:{self.platform_index}:{self.device_index}"

    @property
    def key(self) -> str:
        """Identity of the device and its driver: the device profile is stored under it."""
        return f"{self.platform}|{self.name}|{self.driver}"

    def open(self) -> Any:
        """The pyopencl device this describes."""
        return cl.get_platforms()[self.platform_index].get_devices()[self.device_index]


_PROBE_SOURCE = "__kernel void probe(__global float *out) { out[get_global_id(0)] = 1.0f; }"
_COMPILES: dict[tuple[str, str, str], bool] = {}


def compiles(platform: str, device: Any) -> bool:
    """Whether the device's compiler builds a trivial kernel (once per process and device): a driver whose compiler
    does not know the host CPU (e.g. an older PoCL's LLVM on a newer CPU) lists a device that builds nothing."""
    key = (platform, device.name, device.driver_version)
    if key not in _COMPILES:
        try:
            cl.Program(cl.Context([device]), _PROBE_SOURCE).build()
            _COMPILES[key] = True
        except Exception:  # noqa: BLE001 - cl.RuntimeError (BUILD_PROGRAM_FAILURE), a broken driver, ...
            _COMPILES[key] = False
    return _COMPILES[key]


def list_devices() -> list[DeviceInfo]:
    """Every OpenCL device of every platform whose compiler works (`compiles`); [] when pyopencl or the ICD loader
    finds no platform."""
    if cl is None:
        return []
    try:
        platforms = cl.get_platforms()
    except Exception:  # noqa: BLE001 - cl.LogicError (no platform, PLATFORM_NOT_FOUND_KHR), a broken ICD, ...
        return []
    found = []
    for p_index, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:  # noqa: BLE001 - a platform without usable devices
            continue
        for d_index, dev in enumerate(devices):
            if not compiles(platform.name, dev):
                continue
            kind = "gpu" if dev.type & cl.device_type.GPU else "cpu" if dev.type & cl.device_type.CPU else "accelerator"
            unified = bool(dev.type & cl.device_type.CPU) or bool(getattr(dev, "host_unified_memory", False))
            found.append(DeviceInfo(p_index, d_index, platform.name.strip(), dev.name.strip(),
                                    dev.driver_version.strip(), kind, int(dev.global_mem_size),
                                    int(dev.max_mem_alloc_size), int(dev.max_compute_units), unified))
    return found
