"""lamina's error types: each message says what was expected, what was found and where."""


class GraphError(ValueError):
    """A network that cannot run: unknown names, cycles, shape or type mismatches."""


class InputError(ValueError):
    """Data handed to a network that does not match its declared inputs."""
