"""OpenCL C kernels and their launchers (the OpenCL backend; see issue 4). Empty until that lands."""
