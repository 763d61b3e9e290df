"""Tenants and upload scopes: which uploaded files may serve which sessions.

The resolver and the debug-info sources (this library) scope uploads by tenant, the service's tokens bind
writers to one: the names live here, below both.
"""

from __future__ import annotations

import re

# The agent's --tenant-id: also a directory name under the uploads (service/uploads.py).
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
DEFAULT_TENANT = "default"  # the agent's --tenant-id when none is given
NO_SCOPE = "_"  # sessions whose tenant is no valid name share this one; no token is bound to it


def upload_scope(tenant: str) -> str:
    """The upload scope of a session's tenant: its uploads serve its sessions only (uploads.py). A name of
    the agent's form is its own scope, no tenant the agent's default; anything else falls in NO_SCOPE,
    which no valid name can collide with."""
    if not tenant:
        return DEFAULT_TENANT
    return tenant if TENANT_RE.fullmatch(tenant) else NO_SCOPE
