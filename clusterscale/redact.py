"""Credentials out of URIs: what clusterscale prints or stores never shows a key, secret or token.

The run keeps the real URI in memory (pyarrow needs it); only its displayed and stored forms are redacted.
"""
from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# user:password@ may hold '/' (an unencoded AWS secret does), so after a colon the password runs to the '@';
# a bare user@ stops at the first '/', so an '@' later in a path is left alone.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?:[^\s/@'\"]*:[^\s@'\"]*|[^\s/?#@'\"]+)@")
# access_key=, secret_key=, session_token=, account_key=, password=, X-Amz-Signature=, sig= ...
_SECRET_PARAM = re.compile(r"([?&;][\w.-]*(?:key|secret|token|passw|sig|credential)[\w.-]*=)[^&#\s'\"]*",
                           re.IGNORECASE)


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
