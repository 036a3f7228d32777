"""The run's exceptions and the exit status the recipe maps each one to.

Every rank raises the same one of these with the same line, so that a launcher sees one cause:
`recipes/grpo.py` prints it as `distflow: error: ...` and exits with the status named here. This
module imports nothing, so every wing can raise them.
"""

EXIT_OK = 0
EXIT_ABORTED = 1  # RunAborted
EXIT_CONFIG = 2  # ConfigError: before any model loads
# A rank that stopped on a signal after saving (EX_TEMPFAIL: try again later). Relaunching with the
# same output folder resumes. torchrun itself reports 1 for it; the launchers in launch/ turn that
# back into 75 through the stop file.
EXIT_STOPPED = 75


class ConfigError(ValueError):
    """A user-facing configuration or input problem: reported as one line, exit code 2."""


class RunAborted(RuntimeError):
    """The run cannot go on (non-finite losses for too many steps, a full disk): one line, exit 1."""


class RunComplete(Exception):
    """The folder holds this run, already finished: nothing to train (exit 0)."""
