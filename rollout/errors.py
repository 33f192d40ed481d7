"""What an error says, in one line: for a trajectory's ``metadata["error"]``, a fleet's events and
the commands' last words."""

from __future__ import annotations


def describe_error(error: BaseException) -> str:
    """The exception's type and first line (for an error raised inside a Ray actor, the original
    one's, not Ray's wrapper with its traceback). A validation error (pydantic's, which vLLM's
    config raises) says what failed validation, not its count line ("1 validation error for ...")."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    problems = getattr(error, "errors", None)
    if callable(problems) and type(error).__name__ == "ValidationError":
        try:
            text = "; ".join(str(problem.get("msg", "")) for problem in problems())
        except Exception:  # noqa: BLE001 - a lookalike without pydantic's errors(): its own text
            text = str(error)
    else:
        text = str(error)
    lines = text.strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:1000]
