"""Typed errors: each says what was wrong and what to do about it."""


class TranspilerError(Exception):
    """Base class of every error this package raises on purpose."""


class UnsupportedOptimizerError(TranspilerError):
    """The optimizer is not one the transpiler can express as a graph."""


class UnsupportedModelError(TranspilerError):
    """The model (or loss) cannot be traced into one static graph."""


class ConfigurationError(TranspilerError):
    """Options, world size, rank or process group do not fit together."""


class PipelineSpecError(ConfigurationError):
    """A pass-pipeline spec or mode name could not be parsed."""


class VerificationError(TranspilerError):
    """A verifier found a broken invariant after a pass."""

    def __init__(self, message: str, *, pass_name: str | None = None, passes_before: tuple[str, ...] = ()):
        where = ""
        if pass_name is not None:
            before = ", ".join(passes_before) or "none"
            where = f" (after pass '{pass_name}'; passes before it: {before})"
        super().__init__(message + where)
        self.pass_name = pass_name
        self.passes_before = passes_before


class FactoryError(TranspilerError):
    """A user FACTORY given to the CLI could not be loaded or failed."""


class RankMismatchError(ConfigurationError):
    """The ranks are about to run different programs (found by the startup handshake)."""


class CheckpointError(ConfigurationError):
    """A checkpoint does not fit the step it is loaded into."""


class TraceMismatchError(ConfigurationError):
    """A trace handed to ``transpile(trace=...)`` was made for another model, optimizer, loss or batch."""


class CommunicationError(TranspilerError):
    """A collective failed: a peer rank stalled past the timeout, died, or never arrived."""


class NoQuorumError(CommunicationError):
    """Under ``fault_tolerance``: no quorum of ``min_replicas`` replica groups formed within ``quorum_timeout``
    (the lighthouse is down, too few groups run, or the others have finished the run)."""


class BatchMismatchError(ConfigurationError):
    """A batch does not fit the model or the loss (a shape, dtype or target the first layer or the loss rejects):
    the batch is at fault, not the model's support."""


class RetraceWarning(UserWarning):
    """The step keeps being traced again (new batch shapes or model modes); each trace costs seconds."""


class RenamedWarning(DeprecationWarning):
    """A name that changed (an option, a keyword of ``transpile()``, a spec's option) was used: it still works,
    and the warning names what to write instead (docs/migrating.md)."""
