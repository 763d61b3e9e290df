"""Bearer tokens of the symbolizer: who may read, who may write (and for which tenant), who administers.

Three kinds, each from its own file (docs/deployment.md, "Trust model"):

- write tokens (`--write-tokens-file`): one `TENANT TOKEN` per line. A token bound to a tenant
  stores sessions of that tenant only, and its uploads serve that tenant's sessions only; `*` as
  the tenant makes a shared token (any tenant, named by the agent). `--token-file` (one token, the
  flag of earlier releases) is a shared write token, also accepted on reads for compatibility;
- read tokens (`--read-token-file`, one per line): the read API (sessions, profiles). Giving one
  makes reads require a token, as `--read-token` does;
- admin tokens (`--admin-token-file`): everything, and the admin endpoints (deleting an upload).

Tokens are compared in constant time. The files are read once, at start-up.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from ...compat import SLOTS
from ...errors import BistouriError
from ..tenants import TENANT_RE

ANY_TENANT = "*"

READ = "read"  # sessions, profiles, the UI's API
WRITE = "write"  # ingest, claims, uploads, kernel snapshots
STATE = "state"  # GET of the upload and kernel state agents ask about
ADMIN = "admin"


class TokenFileError(BistouriError):
    """A token file that cannot be used: the message says which and why."""


@dataclass(frozen=True, **SLOTS)
class Grant:
    """What a request's token allows. `tenant` is the tenant a bound write token is limited to,
    None when any (a shared or admin token, or no tokens configured)."""

    kind: str  # "none" (no token configured), "read", "write", "legacy" or "admin"
    tenant: str | None = None


@dataclass(frozen=True)
class Tokens:
    legacy: str | None = None  # --token-file: a shared write token, accepted on reads too
    write: dict[str, str | None] = field(default_factory=dict)  # token -> tenant (None: any)
    read: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    reads_need_token: bool = False  # --read-token, or read tokens given

    @property
    def writes_need_token(self) -> bool:
        return self.legacy is not None or bool(self.write) or bool(self.admin)

    @property
    def any(self) -> bool:
        return self.writes_need_token or bool(self.read)

    def match(self, value: str) -> Grant | None:
        """The grant of a presented token, None if it is none of ours. Every token is compared, in
        constant time each, so the answer's timing says nothing of which kind matched."""
        got = value.encode()
        found: Grant | None = None
        for token in self.admin:
            if hmac.compare_digest(got, token.encode()):
                found = found or Grant("admin")
        if self.legacy is not None and hmac.compare_digest(got, self.legacy.encode()):
            found = found or Grant("legacy")
        for token, tenant in self.write.items():
            if hmac.compare_digest(got, token.encode()):
                found = found or Grant("write", tenant)
        for token in self.read:
            if hmac.compare_digest(got, token.encode()):
                found = found or Grant("read")
        return found

    def allows(self, grant: Grant, need: str) -> bool:
        if grant.kind == "admin":
            return True
        if need == READ:
            return grant.kind in ("read", "legacy")
        if need == WRITE:
            return grant.kind in ("write", "legacy")
        if need == STATE:
            return grant.kind in ("read", "write", "legacy")
        return False

    def required(self, need: str) -> bool:
        """Whether a request of this kind must carry a token at all."""
        if need == READ:
            return self.reads_need_token
        if need == WRITE:
            return self.writes_need_token
        if need == STATE:
            return self.any
        return True  # admin endpoints: only with an admin token


def _lines(path: str, flag: str) -> list[str]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TokenFileError(f"{flag} {path}: cannot read it: {e.strerror}")
    except UnicodeDecodeError:
        raise TokenFileError(f"{flag} {path}: not text")
    lines = [ln.strip() for ln in text.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def read_single(path: str, flag: str) -> str:
    """A file holding one token (--token-file, the form of earlier releases)."""
    lines = _lines(path, flag)
    if not lines:
        raise TokenFileError(f"{flag} {path}: the file is empty; write the token in it")
    if len(lines) > 1 or any(c.isspace() for c in lines[0]):
        raise TokenFileError(f"{flag} {path}: must hold one token without spaces")
    return lines[0]


def read_list(path: str, flag: str) -> tuple[str, ...]:
    """A file of tokens, one a line (# comments)."""
    lines = _lines(path, flag)
    if not lines:
        raise TokenFileError(f"{flag} {path}: the file is empty; write one token a line")
    for i, ln in enumerate(lines, 1):
        if any(c.isspace() for c in ln):
            raise TokenFileError(f"{flag} {path}: entry {i} holds spaces: one token a line")
    return tuple(lines)


def read_write_tokens(path: str, flag: str = "--write-tokens-file") -> dict[str, str | None]:
    """`TENANT TOKEN` lines: the tenant a token writes for (`*`: any)."""
    out: dict[str, str | None] = {}
    lines = _lines(path, flag)
    if not lines:
        raise TokenFileError(f"{flag} {path}: the file is empty; write one 'TENANT TOKEN' a line")
    for i, ln in enumerate(lines, 1):
        parts = ln.split()
        if len(parts) != 2:
            raise TokenFileError(f"{flag} {path}: entry {i}: expected 'TENANT TOKEN' ('*' for any tenant)")
        tenant, token = parts
        if tenant != ANY_TENANT and not TENANT_RE.fullmatch(tenant):
            raise TokenFileError(
                f"{flag} {path}: entry {i}: tenant {tenant!r} must be 1-64 characters of [A-Za-z0-9_.-], "
                "starting alphanumeric, or '*'"
            )
        if token in out:
            raise TokenFileError(f"{flag} {path}: entry {i}: a token given twice")
        out[token] = None if tenant == ANY_TENANT else tenant
    return out


def check_distinct(tokens: Tokens) -> None:
    """One token, one kind: a read token that is also a write token would blur the separation."""
    seen: dict[str, str] = {}
    groups = [
        ("--token-file", [tokens.legacy] if tokens.legacy else []),
        ("--write-tokens-file", list(tokens.write)),
        ("--read-token-file", list(tokens.read)),
        ("--admin-token-file", list(tokens.admin)),
    ]
    for flag, values in groups:
        for v in values:
            if v in seen and seen[v] != flag:
                raise TokenFileError(f"{flag} and {seen[v]} share a token: give each kind its own")
            seen[v] = flag
