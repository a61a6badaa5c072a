"""carpool's C++ CPU kernels, registered as `torch.ops.carpool.*` when this package is imported.

Built by the package's install (setup.py); see csrc/ for what each kernel is for.
"""

from carpool.kernels import _C  # noqa: F401  (loading the library registers the ops)
