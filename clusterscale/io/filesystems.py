"""pyarrow filesystems of local paths and URIs, with S3 credentials in the query and errors a user can act on.

pyarrow's own `FileSystem.from_uri` refuses `?access_key=`, `?secret_key=` and `?session_token=`, quotes the
whole URI (secret included) when it cannot parse it, and raises a bare OSError when a bucket's region cannot be
looked up. Every URI clusterscale opens goes through `resolve_filesystem` here instead.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator
from urllib.parse import unquote

import pyarrow.fs as pafs

from clusterscale.errors import UserError, object_store_error
from clusterscale.redact import ENCODE_ADVICE, redact_uri, uri_problem

# Given to S3FileSystem's constructor, which takes them; pyarrow's URI parser does not.
S3_CREDENTIAL_PARAMS = ("access_key", "secret_key", "session_token")
S3_URI_PARAMS = ("region", "scheme", "endpoint_override", "allow_bucket_creation", "allow_bucket_deletion",
                 "tls_ca_file_path", "tls_verify_certificates", *S3_CREDENTIAL_PARAMS)


class UriError(UserError, ValueError):
    """A URI that cannot be opened as written; the message shows it redacted and says how to write it."""


def resolve_filesystem(uri_or_path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a pyarrow filesystem URI.

    Errors are UserErrors whose message shows the URI redacted; pyarrow's own error is not chained (it quotes
    the URI in clear)."""
    if "://" not in uri_or_path:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri_or_path))
    try:
        return _from_uri(uri_or_path)
    except UserError:
        raise
    except ValueError as err:  # pa.ArrowInvalid is a ValueError; so is S3FileSystem's refusal of its arguments
        raise UriError(f"{redact_uri(uri_or_path)} cannot be opened: {_parse_problem(uri_or_path, err)}.") from None
    except OSError as err:  # from_uri looks up an S3 bucket's region over the network
        raise (object_store_error(err, uri_or_path)
               or UriError(f"{redact_uri(uri_or_path)} cannot be opened: {redact_uri(str(err))}.")) from None


def _from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    problem = uri_problem(uri)
    if problem:  # pyarrow's message would quote the URI, and the position of the bad character in the secret
        raise UriError(f"{redact_uri(uri)} is not a valid URI: {problem}. {ENCODE_ADVICE}.")
    base, sep, query = uri.partition("?")
    if not (base.lower().startswith("s3://") and sep):
        return pafs.FileSystem.from_uri(uri)
    kept, credentials = [], {}
    for item in query.split("&"):
        name, _, value = item.partition("=")
        if name in S3_CREDENTIAL_PARAMS:
            credentials[name] = unquote(value)  # not unquote_plus: a literal '+' of a base64 secret stays '+'
        else:
            kept.append(item)
    fs, path = pafs.FileSystem.from_uri(base + ("?" + "&".join(kept) if kept else ""))
    if not credentials:
        return fs, path
    rebuild, (options,) = fs.__reduce__()  # how pickling rebuilds it: every option from_uri set, kept
    options = options | credentials
    if bool(options["access_key"]) != bool(options["secret_key"]) or (
            options["session_token"] and not options["access_key"]):
        raise UriError(f"{redact_uri(uri)}: give access_key and secret_key together (in the query or as "
                       f"KEY:SECRET@), and a session_token only with both; or leave all three to the environment "
                       f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN).")
    return rebuild(options), path


def _parse_problem(uri: str, err: ValueError) -> str:
    """What pyarrow refused, without its text where that quotes the URI."""
    unexpected = re.search(r"Unexpected query parameter in \w+ URI: '([\w.-]*)'", str(err))
    if unexpected:
        accepted = f" (an s3:// URI takes {', '.join(S3_URI_PARAMS)})" if uri.lower().startswith("s3://") else ""
        return f"its query parameter {unexpected.group(1)!r} is not one this filesystem takes{accepted}; remove it"
    if "Cannot parse URI" in str(err):
        return f"it is not a valid URI. {ENCODE_ADVICE}"
    return redact_uri(str(err))


@contextlib.contextmanager
def filesystem_errors(uri: str) -> Iterator[None]:
    """Turn an object store's refusal (unreachable endpoint, unknown bucket, denied credentials) while using
    `uri` into an ObjectStoreError naming `uri` (redacted), not chained to pyarrow's error."""
    try:
        yield
    except OSError as err:
        found = object_store_error(err, uri)  # None for a UserError (named already) and for any other OSError
        if found is None:
            raise
        raise found from None
