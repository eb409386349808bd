"""DeviceInfo and list_devices under their former module, for tests/runtime_support.py (the package imports them
from glmkit.backends.opencl.device); to be deleted once that file does too."""

from glmkit.backends.opencl.device import DeviceInfo, list_devices

__all__ = ["DeviceInfo", "list_devices"]
