"""Store and load jobs in flight on the daemon (Job), their Result, and
a request waiting for its answer (_Pending).
"""

import dataclasses
import threading
import time

from . import protocol as p
from .errors import _again


@dataclasses.dataclass
class Result:
    """Outcome of a job: per key (outcome, error code), bytes, duration."""
    keys: list
    bytes: int
    duration_ns: int
    message: str

    def count(self, outcome):
        return sum(1 for o, _ in self.keys if o == outcome)

    def outcomes(self):
        return [p.OUTCOMES[o] if o < len(p.OUTCOMES) else str(o) for o, _ in self.keys]

    def codes(self):
        """Each key's error code by name: "ok" for a key that did not fail,
        "destination changed" for a load key whose blocks the client's own
        memory changed under the load (the file is good: load it again into
        blocks nothing else writes), code(N) for a newer daemon's code."""
        return [p.code_name(c) for _, c in self.keys]


class Job:
    """A store or load job in flight on the daemon. A job sent without
    waiting for the daemon to accept it (block=False) has id None until
    the daemon's answer comes; a refusal then ends it, raised by wait()."""

    def __init__(self, client, job_id, request):
        self._client = client
        self.id = job_id
        self._request = request  # (kind, key count) its completion must have
        self._event = threading.Event()
        self._accepted = threading.Event()  # id known, or the job over
        if job_id is not None:
            self._accepted.set()
        self._result = None
        self._error = None
        # When this client's reader took the completion (time.monotonic;
        # None before): beside the daemon's duration_ns, how long the
        # answer took to reach this process.
        self.ended_at = None

    def _accept(self, job_id):
        self.id = job_id
        self._accepted.set()

    def _finish(self, result, error):
        self.ended_at = time.monotonic()
        self._result, self._error = result, error
        self._event.set()
        self._accepted.set()

    def done(self):
        """Whether the job is over: completed, refused, or its connection lost."""
        return self._event.is_set()

    def wait(self, timeout=None):
        """Waits for the completion and returns its Result; raises
        TimeoutError, KvhostError when the daemon refused the job, or
        ConnectionLost when no completion can come."""
        if not self._event.wait(timeout):
            what = "not yet accepted" if self.id is None else self.id
            raise TimeoutError(f"job {what} not complete after {timeout}s")
        if self._error is not None:
            raise _again(self._error)
        return self._result

    def cancel(self):
        """Asks the daemon to cancel the job; True if it was still in
        flight. A job not yet accepted waits for the daemon's answer first
        (up to the client's timeout, then TimeoutError)."""
        if not self._accepted.wait(self._client._timeout):
            raise TimeoutError(f"the daemon has not accepted the job after {self._client._timeout}s")
        if self.id is None or self._event.is_set():
            return False
        return self._client.cancel(self)


class _Pending:
    __slots__ = ("event", "asked", "ftype", "body", "error", "unanswered")

    def __init__(self, asked, unanswered=None):
        # What a caller waits on (_call); a job's Job is its own signal.
        self.event = threading.Event() if unanswered is None else None
        self.asked = asked  # the request's type
        self.ftype = self.body = self.error = None
        # A job sent with block=False: the reader accepts or ends it, as
        # no caller waits for this request's answer.
        self.unanswered = unanswered
