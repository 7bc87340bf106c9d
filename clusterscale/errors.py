"""The user-error base class, and `user_message`: the one paragraph the CLI and the jobs print for a user fault."""
from __future__ import annotations

import errno
import importlib
import os
import re
import reprlib
from typing import Any, Iterator

from clusterscale.redact import redact_uri


class UserError(Exception):
    """A fault the user can fix. The CLI and the jobs print its message (what was wrong, what was
    found, what to do) as one paragraph and exit 2, also when it was raised inside a Ray task or actor."""


class StorageError(UserError, OSError):
    """A full disk, a read-only file system or a missing permission: the user frees space or picks a --run-dir."""


class ObjectStoreError(UserError, OSError):
    """An object store that cannot be reached, or refuses the credentials: the user fixes the endpoint, region,
    credentials or network."""


OBJECT_STORE_ADVICE = (
    "Check the bucket name and that this machine can reach the store; for an S3-compatible store (MinIO, Ceph, "
    "an S3 on loopback) name its endpoint in the URI (?endpoint_override=HOST:PORT&scheme=http) or in "
    "AWS_ENDPOINT_URL_S3; for AWS, give the bucket's region (?region=NAME in the URI skips the region lookup) and "
    "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the node's role, or KEY:SECRET@ in the URI)")
# pyarrow's S3 errors: "When getting information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION ...".
_AWS_ERROR = re.compile(r"AWS Error [A-Z_]+")


STORAGE_ADVICE = {
    errno.ENOSPC: "free space on that disk (or choose a --run-dir on one with room) and rerun; completed stages "
                  "are kept",
    errno.EDQUOT: "free space within your quota (or choose a --run-dir elsewhere) and rerun; completed stages are "
                  "kept",
    errno.EROFS: "choose a writable --run-dir",
    errno.EACCES: "this user may not write (or read) there: choose a writable --run-dir, or fix the permissions",
    errno.EPERM: "this user may not write (or read) there: choose a writable --run-dir, or fix the permissions",
}
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 2


def bounded_repr(value: Any) -> str:
    """repr() for error messages, bounded in size and in work (a YAML alias bomb is never expanded). A string is
    redacted before it is cut short: a cut could drop the '@' that marks where a URI's secret ends."""
    return _REPR.repr(redact_uri(value) if isinstance(value, str) else value)


def storage_error(exc: OSError, path: str | None = None) -> StorageError | None:
    """The user-facing form of an OSError the user fixes on the storage side; None for any other errno.

    `path`: the file being written or read, where the caller knows it (pyarrow names the path in strerror only
    sometimes, and a bare OSError names nothing); else the error's own filename or text."""
    if exc.errno not in STORAGE_ADVICE:
        return None
    detail = exc.strerror or str(exc)
    if path:
        where = f"writing {path}" + (f"; {detail}" if detail != os.strerror(exc.errno) else "")
    elif exc.filename:
        where = str(exc.filename)
    elif detail != os.strerror(exc.errno):  # pyarrow's text, which names the path when it says more
        where = detail
    else:
        where = "the path was not reported; most likely under --run-dir"
    found = StorageError(f"{os.strerror(exc.errno)} ({where}): {STORAGE_ADVICE[exc.errno]}.")
    found.errno = exc.errno
    return found


def object_store_error(exc: BaseException, uri: str | None = None) -> ObjectStoreError | None:
    """The user-facing form of an object store's refusal or silence (pyarrow's "AWS Error ..." OSErrors); None
    for any other error. `uri`: the URI being opened, named (redacted) in the message where the caller knows it."""
    if not isinstance(exc, OSError) or isinstance(exc, UserError) or not _AWS_ERROR.search(str(exc)):
        return None
    where = f"{redact_uri(uri)}: " if uri else ""
    return ObjectStoreError(f"{where}the object store cannot be used: {redact_uri(str(exc))}. {OBJECT_STORE_ADVICE}.")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and, breadth first, what it wraps: Python's chain, Ray's `.cause`, Ray Train's worker failures."""
    queue, seen = [exc], set()
    while queue:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "worker_failures", None)  # ray.train.WorkerGroupError: {rank: exception}
        nested = [getattr(current, "cause", None), getattr(current, "controller_failure", None),
                  *(failures.values() if isinstance(failures, dict) else ()), current.__cause__, current.__context__]
        queue.extend(e for e in nested if isinstance(e, BaseException))


# Ray Data's UDF errors and actors that die in __init__ carry the original only as traceback text.
_USER_LINE = re.compile(r"^(clusterscale(?:\.\w+)+)\.(\w+): (.*?)(?=\n\s*\n|\Z)", re.MULTILINE | re.DOTALL)
_OSERROR_LINE = re.compile(r"^\w*(?:Error|Exception): \[Errno (\d+)\] (.*)$", re.MULTILINE)
_AWS_ERROR_LINE = re.compile(r"^(?:OSError|IOError): (.*AWS Error [A-Z_]+.*)$", re.MULTILINE)


def _from_traceback_text(text: str) -> Exception | None:
    for module, name, message in _USER_LINE.findall(text):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, UserError):
            return UserError(message.strip())
    for number, detail in _OSERROR_LINE.findall(text):
        found = storage_error(OSError(int(number), detail))
        if found:
            return found
    aws = _AWS_ERROR_LINE.search(text)
    return object_store_error(OSError(aws.group(1))) if aws else None


def _is_out_of_disk(exc: BaseException) -> bool:
    from ray.exceptions import OutOfDiskError  # only reached once Ray has raised something

    return isinstance(exc, OutOfDiskError)


def _is_ray_wrapper(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("ray.")


def user_error(exc: BaseException) -> Exception | None:
    """The user fault behind `exc` (also raised inside a Ray task, actor, Ray Data UDF or Ray Train worker),
    or None when `exc` is a bug (shown with its traceback)."""
    chain = list(_causes(exc))
    for current in chain:
        # Ray re-raises a task's error as a subclass of it whose message is the whole remote traceback.
        if isinstance(current, UserError) and not _is_ray_wrapper(current):
            return current
    for current in chain:
        if isinstance(current, OSError) and not _is_ray_wrapper(current) and (
                found := storage_error(current) or object_store_error(current)):
            return found
        if _is_out_of_disk(current):
            return StorageError("A Ray node's local disk is over its capacity threshold (95% by default), so Ray can "
                                "no longer spill objects: free space on it (`df`; Ray's temp dir is /tmp/ray by "
                                "default) and rerun; completed stages are kept.")
    for current in chain:
        if _is_ray_wrapper(current):
            found = _from_traceback_text(str(current))
            if found:
                return found
    return None


def user_message(exc: BaseException) -> str | None:
    """The one paragraph to print for a user fault (credentials redacted); None when `exc` is not one."""
    found = user_error(exc)
    return None if found is None else redact_uri(str(found).strip())
