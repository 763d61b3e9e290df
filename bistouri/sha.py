"""SHA-256 without OpenSSL: the interpreter's own implementation, the same digests.

`import hashlib` maps libcrypto (~3.9 MB of RSS), which `bistouri record` needs for nothing else:
its symbolization hashed a boot key, a few kallsyms lines and a path with it, at the run's peak
of memory. CPython builds its own SHA-256 in (`_sha2` from 3.12, `_sha256` before: what hashlib
falls back to without OpenSSL). It is slower on large inputs (5 MB: 22 ms against 3.4), which
none of these are.
"""

from __future__ import annotations

try:
    from _sha2 import sha256
except ImportError:
    try:
        from _sha256 import sha256  # before 3.12
    except ImportError:
        from hashlib import sha256  # an interpreter without either

__all__ = ["sha256"]
