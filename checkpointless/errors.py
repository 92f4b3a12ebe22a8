"""Every exception the package raises on purpose, in one hierarchy.

``CheckpointlessError`` is the root: ``except CheckpointlessError`` catches what the
package means to raise and lets bugs through. Below it, the errors split by who
must act:

* recoverable by the runtime: ``CollectiveError`` (a peer died mid-collective),
  ``IntegrityError`` (received state is malformed or forged), ``InjectedFault``
  (a scheduled test fault);
* the user's training script: ``FatalError`` (no recovery can fix it);
* the job as a whole: ``PlanError`` (no correct recovery plan), ``JobFailed``
  (the coordinator gives up), ``JobStopped`` (a waiting spare learns the job ended);
* user input, reported as one line with exit code 2: ``LaunchError``,
  ``RecipeError``, ``UsageError``.

``JobInterrupted`` (SIGINT/SIGTERM at the launcher) is a ``BaseException``, like
``KeyboardInterrupt``, so that ``except Exception`` in user callbacks cannot eat it; so is
``Dismissed`` (a ``SystemExit``: a process a smaller job let go).
The core modules re-export the class they raise (``checkpointless.comm.CollectiveError``
is this module's class), so either import path works.
"""

from __future__ import annotations

import signal


class CheckpointlessError(Exception):
    """Root of the errors the package raises on purpose."""


class Dismissed(SystemExit):
    """A smaller job let this process go (``checkpointless scale``): it exits with status 0 without
    the rest of its script. A ``SystemExit``, so that ``except Exception`` cannot keep it training."""


class CatchUpFailed(CheckpointlessError):
    """A spare's catch-up ended before it became a member (its source gave it up, or failed)."""


class CollectiveError(CheckpointlessError, RuntimeError):
    """A collective of the current generation failed."""


class StepRecovered(CheckpointlessError):
    """The attempt failed and the member already entered the next generation (``takeover``): the
    step runs again there, nothing more to recover."""


class ExchangeRefused(CheckpointlessError):
    """An exchange of results between the ranks (``shards.exchange``) that no rank may use: a
    rank's results are not plain data, or the ranks cut the work differently. Every rank raises
    it, after the same messages (the group still works)."""


class IntegrityError(CheckpointlessError, RuntimeError):
    """Received state is malformed, or does not match the digest or MAC its source sent."""


class InjectedFault(CheckpointlessError, RuntimeError):
    """The exception raised by an ``exception`` fault inside the training step."""


class FatalError(CheckpointlessError, RuntimeError):
    """A mistake in the training script that no recovery can fix; the job ends with its message."""


class Unrecoverable(CheckpointlessError):
    """A part of a session found what no recovery can fix (a build that returns no sharded model, a
    formation that never ends, no durable snapshot to roll back to): the member ends the job with
    its message, as a ``FatalError``. Not a ``RuntimeError``: never taken for a peer's failure."""


class PlanError(CheckpointlessError, RuntimeError):
    """No correct plan exists (no spare, or no live replica of some shard)."""


class JobFailed(CheckpointlessError, RuntimeError):
    """The job cannot continue; the message says why."""


class JobStopped(CheckpointlessError, RuntimeError):
    """The job ended while this process was waiting (a spare that was never used)."""


class UserInputError(CheckpointlessError, ValueError):
    """A user mistake: the command line reports it as one line and exits with code 2."""


class LaunchError(UserInputError):
    """The job could not be started (bad port, ...): a user-facing, one-line message."""


class UsageError(UserInputError):
    """A bad command line: reported as one line, exit code 2."""


class RecipeError(UserInputError):
    """A recipe value is invalid.

    ``key`` is the dotted key at fault (``optim.lr``; empty when the whole file is at
    fault), ``message`` says what is wrong and ``source`` is the recipe file, if any. The
    string form is ``"<source>: <key>: <message>"``.
    """

    def __init__(self, key: str, message: str, *, source: str = "", text: str | None = None) -> None:
        self.key = key
        self.message = message
        self.source = source
        body = text if text is not None else (f"{key}: {message}" if key else message)
        super().__init__(f"{source}: {body}" if source else body)

    def located(self, key: str, source: str) -> RecipeError:
        """The same error re-keyed to the full dotted ``key`` and attributed to ``source``."""
        return RecipeError(key, self.message, source=source)


class UnsupportedTorch(CheckpointlessError):
    """A private torch name that this torch lacks or changed (``checkpointless._compat``). Not a
    ``RuntimeError``: no ``except RuntimeError`` around a collective takes it for a peer's failure."""


class JobInterrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
