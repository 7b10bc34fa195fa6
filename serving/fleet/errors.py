"""The fleet's one error: what it raises when a replica, a gateway or the platform under them does not
answer. A ``LifecycleError``, so every CLI prints it as one line."""

from artifacts.errors import LifecycleError


class FleetError(LifecycleError):
    """A replica or gateway cannot be started, reached or registered, or the fleet's record is unreadable."""
