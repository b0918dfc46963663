"""Expected errors: the CLI prints them as one red line and exits 1 (no traceback)."""

from __future__ import annotations

from dataclasses import dataclass

# Exit code of a job worth running again: the cluster failed (a node never joined or was
# lost) or the trainer checkpointed on a warning (Slurm's USR1). EX_TEMPFAIL; Slurm's
# requeue and managed-job recovery key on it.
TRY_AGAIN = 75


class RlxError(Exception):
    """An error the user can fix; its message says what is wrong and what to do."""

    exit_code = 1  # TRY_AGAIN where running the job again later may succeed


def first_line(exc: BaseException) -> str:
    """The first line of an error's text, or its type's name where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True)
class Finding:
    """One lint or schema finding, tied to a place in a recipe file."""

    file: str
    line: int
    severity: str  # "error" | "warning"
    field: str  # dotted path, e.g. "trainer.rollout.n"
    message: str

    def format(self) -> str:
        return f"{self.file}:{self.line}: {self.severity}: {self.field}: {self.message}"


class RecipeError(RlxError):
    """A recipe that cannot be loaded: one or more findings, all errors."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("\n".join(f.format() for f in findings))
