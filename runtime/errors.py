"""lamina's error types, all of them in this one module (and at the package's top level): each
message says what was expected, what was found and where. This module imports nothing of
lamina's, so every other module may raise them."""
from __future__ import annotations


class GraphError(ValueError):
    """A network that cannot run: unknown names, cycles, shape or type mismatches."""


class InputError(ValueError):
    """Data handed to a network that does not match its declared inputs."""


class SequenceError(ValueError):
    """Sequence offsets that do not describe a batch of sequences (lamina.Sequences)."""


class SettingError(ValueError):
    """A setting that is not valid: a thread count that is not a positive integer (LAMINA_THREADS,
    set_num_threads), or an unknown LAMINA_BLAS or LAMINA_LOW_PRECISION."""


class IndexRangeError(ValueError):
    """An index argument of a kernel lies outside the array it indexes."""


class ModelFileError(ValueError):
    """A model file that cannot be loaded; the message names the file and the problem."""


class NonFiniteModelError(ValueError):
    """A model with NaN or infinity among its parameters: it is not written (it could not be
    loaded back, and it must never replace a good file)."""


class UnsupportedModelError(ModelFileError):
    """An ONNX model using operators or attributes lamina cannot run; `problems` lists every
    (node name, operator, what) found."""

    def __init__(self, where: str, problems: list) -> None:
        self.problems = problems
        lines = "\n".join(f"  - node '{n}' ({op}): {what}" for n, op, what in problems)
        super().__init__(f"{where}: lamina cannot run {len(problems)} part(s) of this model:\n{lines}")


class OpenCLError(RuntimeError):
    """The OpenCL backend cannot start or run: pyopencl or a device is missing, or a kernel
    failed to build."""


class MissingExtra(ImportError):
    """A package of an optional extra is not installed; the message names the extra."""


class ProtocolError(Exception):
    """A request the inference protocol refuses: `status` (400 unless said) and a message for
    the error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ServerError(Exception):
    """The server refused a request (lamina.serve.Client): `status` and the error body's
    message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class TrainingStopped(KeyboardInterrupt):
    """Training stopped by a signal between steps, after its checkpoint (lamina.training.fit):
    `signum` is SIGINT (Ctrl-C) or SIGTERM (what kill and job schedulers send). A
    KeyboardInterrupt, as Ctrl-C always was."""

    def __init__(self, signum: int = 2) -> None:
        import signal
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class GradientCheckError(AssertionError):
    """A gradient check (lamina.testing.check_gradients) found backward and the central
    differences apart."""


PUBLIC = ["GraphError", "InputError", "SequenceError", "SettingError", "IndexRangeError", "ModelFileError",
          "NonFiniteModelError", "UnsupportedModelError", "OpenCLError", "MissingExtra", "ProtocolError",
          "ServerError", "TrainingStopped", "GradientCheckError"]
