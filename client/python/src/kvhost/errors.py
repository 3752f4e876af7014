"""The errors of the kvhost client: a daemon's error reply (KvhostError,
UnsupportedError) and a connection closed or lost (ConnectionLost).
"""

from . import protocol as p


class KvhostError(Exception):
    """An error reply of the daemon: code (see protocol.CODES) and message."""

    def __init__(self, code, message=""):
        self.code = code
        self.message = message
        name = p.code_name(code)
        super().__init__(f"kvhost: {name}: {message}" if message else f"kvhost: {name}")


class UnsupportedError(KvhostError):
    """The daemon cannot serve a valid request (e.g. CUDA IPC memory)."""


class ConnectionLost(Exception):
    """The connection to the daemon is closed. Where the daemon closed it
    with an Error frame saying why (request id 0: a deadline of the
    connection passed, the daemon is shutting down), code is that error's
    code (see protocol.CODES) and message its message; else code is None."""

    def __init__(self, what="the connection to the daemon is closed", code=None, message=""):
        super().__init__(what)
        self.code = code
        self.message = message


def _closed_by_daemon(code, message):
    """The ConnectionLost of the daemon's Error frame about the connection
    itself, which it closes after it."""
    name = p.code_name(code)
    return ConnectionLost(f"kvhost: the daemon closed the connection: {name}: {message}", code, message)


def _again(err):
    """A new exception equal to err, the error that closed a connection,
    for one more caller. Raising the stored one again would chain every
    caller's frames onto its one traceback, which the client keeps: their
    locals (a vLLM tier and the region it was given, say) would stay alive
    until the garbage collector finds the cycle."""
    if isinstance(err, KvhostError):
        return type(err)(err.code, err.message)
    if isinstance(err, ConnectionLost):
        return type(err)(*err.args, code=err.code, message=err.message)
    return type(err)(*err.args)


def _refusal(ftype, body, asked=None):
    """The error of a request answered with ftype and body instead of its
    reply: the daemon's Error frame, else a ProtocolError."""
    if ftype == p.T_ERROR:
        code, msg = p.decode_error(body)
        if code == p.CODE_UNSUPPORTED:
            return UnsupportedError(code, msg)
        return KvhostError(code, msg)
    what = "?" if asked is None else f"{asked:#x}"
    return p.ProtocolError(f"request type {what} answered with {ftype:#x}")
