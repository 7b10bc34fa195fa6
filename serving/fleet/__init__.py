"""The fleet: the gateway and one engine replica per snapshot, on a backend (processes on this machine, or
Ray actors), found again from its record by every later ``deploy`` command. It knows nothing of rollouts:
``serving.rollout`` drives it, and ``deploy snapshot`` uses it without one."""

from artifacts.common.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "serving.fleet.fleet": ["Fleet"],
    "serving.fleet.errors": ["FleetError"],
})
