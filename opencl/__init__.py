"""The OpenCL C sources of the OpenCL backend, as package data: lamina.backends.opencl builds
them once per device and element type."""
