"""Error types shared by every stage.

Every error a user can cause (bad config, bad dataset, bad bundle, bad request) derives from
`LifecycleError`, so the CLI can answer with one line and a non-zero exit instead of a traceback.
"""


class LifecycleError(Exception):
    """Base class for errors whose message is meant for the user, not for a debugger."""


class ConfigError(LifecycleError):
    """A recipe or config value is unknown, missing or out of range; the message names key and file."""


def one_line(text: str) -> str:
    """Fold a message that embeds a library's multi-line error into the single line the CLI prints."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


class BundleError(LifecycleError):
    """A bundle cannot be written or planned (bad source dir, overwrite, TP degree that does not fit)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class BundleVerificationError(BundleError):
    """A bundle on disk disagrees with its manifest or its config; the message is `<file>: <reason>`."""

    def __init__(self, file: str, reason: str) -> None:
        self.file = file
        self.reason = one_line(reason)
        super().__init__(f"{file}: {self.reason}")

    def __reduce__(self):  # picklable across process boundaries (Prefect task results, workers)
        return type(self), (self.file, self.reason)


class EvalRecordError(LifecycleError):
    """An eval record is missing, malformed, or refers to a different manifest than the bundle's."""


class RegistryError(LifecycleError):
    """A registry operation failed: unknown model/alias/version, or a downloaded bundle that disagrees."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))
