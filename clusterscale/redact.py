"""Credentials out of URIs: what clusterscale prints or stores never shows a key, secret or token.

The run keeps the real URI in memory (pyarrow needs it); only its displayed and stored forms are redacted.
`redacted_output` also redacts everything the process prints (Ray workers' forwarded output, log lines,
tracebacks) while a command runs.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

Command = TypeVar("Command", bound=Callable[..., Any])

REDACTED = "***"
# Userinfo, however malformed: an unencoded password may hold '/', '@', '?', '#', spaces or a bad '%zz', so
# after user + ':' the password runs to the LAST '@' on the line. Where no colon follows the user, the userinfo
# runs to the last '@' before the first '/' (an '@' later in a path, as in gs://b/team/jane@x.com/, is left alone).
# The price is over-redaction: 'hdfs://nn:8020/a/jane@corp/x' shows as 'hdfs://***@corp/x'; a password that
# begins with digits and holds a '/' cannot be told from a port, and a leaked secret is the worse mistake.
# uri_problem refuses every URI this reading and the parser's disagree on, before it is used.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?:[^\s/:@?#]*:[^\n]*|[^\s/?#]+)@")
# access_key=, secret_key=, session_token=, account_key=, password=, X-Amz-Signature=, sig=, X-Amz-Credential= ...
# The value runs to the next '&' or the end of the line (a malformed value may hold spaces or quotes); a value
# that is already *** (then '&', punctuation of the message around it, or the end) is left as it is, so that
# redacting a message that quotes a redacted URI changes nothing.
_SECRET_PARAM = re.compile(r"([?&;][\w.-]*(?:key|secret|token|passw|sig|credential)[\w.-]*=)"
                           rf"(?!{re.escape(REDACTED)}(?![\w/+%=~-]))[^&\n]*", re.IGNORECASE)


def redact_uri(text: str) -> str:
    """`text` (a URI, or a message holding URIs) with every credential replaced by ***."""
    return _SECRET_PARAM.sub(rf"\1{REDACTED}", _USERINFO.sub(rf"\1{REDACTED}@", text))


def redact_values(obj: Any) -> Any:
    """A copy of a JSON-like object with redact_uri applied to every string (keys included)."""
    if isinstance(obj, str):
        return redact_uri(obj)
    if isinstance(obj, dict):
        return {redact_values(k): redact_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_values(v) for v in obj]
    return obj


class RedactingStream:
    """A text stream that redacts what is written to it, then passes it on (everything else is the stream's).

    Each write is redacted on its own: print(), logging and Ray's forwarding of worker output write a line (or
    a whole message) at a time, so a URI is never split between two writes."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact_uri(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, buffer, ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """While it is open, sys.stdout, sys.stderr and the log handlers writing to them redact URIs.

    Ray prints its workers' forwarded output to sys.stdout/sys.stderr as they are at the time, and logging
    handlers keep the stream they were made with, so both are switched; all is restored on exit."""
    originals = {"stdout": sys.stdout, "stderr": sys.stderr}
    if any(isinstance(s, RedactingStream) for s in originals.values()):  # already inside one (a nested call)
        yield
        return
    wrapped = {id(s): RedactingStream(s) for s in originals.values()}
    handlers = {id(h): h for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                for h in getattr(logger, "handlers", ())
                # (a handler whose stream is a property, as logging.lastResort's, follows sys.stderr by itself)
                if isinstance(h, logging.StreamHandler) and id(vars(h).get("stream")) in wrapped}
    switched = [(h, h.stream) for h in handlers.values()]
    for handler, stream in switched:
        handler.setStream(wrapped[id(stream)])
    sys.stdout, sys.stderr = wrapped[id(originals["stdout"])], wrapped[id(originals["stderr"])]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = originals["stdout"], originals["stderr"]
        for handler, stream in switched:
            handler.setStream(stream)


def _redacting(hook: Callable) -> Callable:
    """`hook` (sys.excepthook, threading.excepthook: Ray's, pytest's or Python's) printing with URIs redacted."""
    if getattr(hook, "redacts", False):
        return hook

    @functools.wraps(hook)
    def redacting_hook(*args: Any) -> Any:
        with redacted_output():
            return hook(*args)
    redacting_hook.redacts = True  # type: ignore[attr-defined]
    return redacting_hook


def redacted_command(command: Command) -> Command:
    """An entry point (cli.main, a job) whose output, and the tracebacks Python prints for its uncaught
    exceptions (a bug's, or one in a thread), show no credential."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        sys.excepthook, threading.excepthook = _redacting(sys.excepthook), _redacting(threading.excepthook)
        with redacted_output():
            return command(*args, **kwargs)
    return run  # type: ignore[return-value]


# What RFC 3986 (and so pyarrow's URI parser) allows unencoded; '[' and ']' too, for globs and IPv6 hosts.
_URI_CHARS = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?#\[\]]|%[0-9A-Fa-f]{2})*")
_AUTHORITY = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://([^/?#]*)")
ENCODE_ADVICE = ("Percent-encode a key or secret written into a URI ('/' as %2F, '@' as %40, ':' as %3A, a space "
                 "as %20, '%' as %25), or better, leave credentials out of it: AWS_ACCESS_KEY_ID, "
                 "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN in the environment, or the node's role")


def uri_problem(uri: str) -> str | None:
    """Why `uri` is not a URI pyarrow can parse (mostly: a credential written into it unencoded), said without
    quoting the URI; None for a well-formed URI or a plain path. Cheap and offline, so it runs at config load."""
    authority = _AUTHORITY.match(uri)
    if authority is None:
        return None
    if not _URI_CHARS.fullmatch(uri):
        return "it holds a character a URI cannot hold unencoded (a space, a '%' not followed by two hex digits, ...)"
    userinfo, at, host_port = authority.group(1).rpartition("@")
    if "@" in userinfo:
        return "more than one '@' precedes its host"
    port = (host_port.rpartition("]")[2] if host_port.startswith("[") else host_port).partition(":")[2]
    if port and not port.isdigit():
        return "what follows '://' up to the first '/' is not host[:port] (a secret holding a '/'?)"
    shown = _USERINFO.match(uri)
    if shown and shown.end() != authority.start(1) + len(userinfo) + len(at):
        # redact_uri hides up to the last '@'; the parser takes the host (bucket) from before it: the part
        # between them may be the secret's tail, and would be shown and used as the bucket.
        return ("it is ambiguous: it reads as user:secret@host (a ':' after '://', an '@' later), but a second '@' "
                "or a '/' comes before the last '@', so where the secret ends and the host (bucket) begins cannot "
                "be told; write an '@' of the path as %40")
    return None
