"""Who a request is: the front end's API keys and the tenant each names.

- ``frontend.api_key_file``: one key; its requests are ``frontend.default_tenant``'s.
- ``frontend.api_keys_file``: a key per tenant, one per line (``<tenant> <key>``; blank
  lines and ``#`` comments skipped); a request sent with a key is its tenant's.
- Neither: no key is asked for (loopback use); every request is the default tenant's.

A request's tenant is then its key's tenant, with vLLM's ``cache_salt`` (when it sends
one) below it: ``acme/<salt>``. The tenant names the root of the request's block keys
(dualpath/kv/prefix.py tenant_root), so no tenant hits another's stored KV, and a salt
separates hits within a tenant as it does in vLLM; the store charges every block of
``acme`` and ``acme/<salt>`` to the account ``acme`` (its quota: docs/storage.md). With
an unnamed default tenant (``""``, no keys) the salt alone is the tenant, as in vLLM:
anyone may send any salt there, so API keys with tenants are what separates users who
do not trust each other (``FrontendConfig.validate`` refuses a shared key beside them
unless the default tenant is named). The tenant is also the ``cache_salt`` the vLLM
instances get, so their own prefix caches are split the same way.

Keys are compared by their SHA-256 digests (a dict lookup of a digest leaks nothing
usable about a key); a key shorter than 16 characters is refused at start-up.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from dualpath.errors import ConfigError
from dualpath.kv.prefix import MAX_TENANT_CHARS

MIN_KEY_CHARS = 16
MAX_NAME_CHARS = 64
MAX_KEYS = 100_000
_NAME = re.compile(rf"[A-Za-z0-9._:@-]{{1,{MAX_NAME_CHARS}}}")


def check_name(name: str, what: str) -> None:
    """ConfigError naming ``what`` unless ``name`` is a tenant account's name."""
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{what}: tenant {name[:80]!r} is not a name (1 to "
                          f"{MAX_NAME_CHARS} of A-Z a-z 0-9 . _ : @ -)")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The front end's keys (module docstring). ``required``: whether a request must
    send one; :meth:`tenant_of` the tenant a header's key names (None: refused)."""

    def __init__(self, key_file: str, keys_file: str, default_tenant: str):
        self.default = default_tenant
        self._tenants: dict[bytes, str] = {}
        if key_file:
            self._add(self._read(key_file, "frontend.api_key_file").strip(), default_tenant,
                      "frontend.api_key_file")
        if keys_file:
            what = "frontend.api_keys_file"
            for n, line in enumerate(self._read(keys_file, what).splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise ConfigError(f"{what} line {n}: expected '<tenant> <key>'")
                check_name(parts[0], f"{what} line {n}")
                self._add(parts[1], parts[0], f"{what} line {n}")
                if len(self._tenants) > MAX_KEYS:
                    raise ConfigError(f"{what}: more than {MAX_KEYS} keys")
        self.required = bool(self._tenants)

    @staticmethod
    def _read(path: str, what: str) -> str:
        try:
            return Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{what}: {e}") from None

    def _add(self, key: str, tenant: str, what: str) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{what}: the key must be {MIN_KEY_CHARS} characters or more")
        d = _digest(key.encode())
        if d in self._tenants:
            raise ConfigError(f"{what}: the same key is given twice")
        self._tenants[d] = tenant

    def __len__(self) -> int:
        return len(self._tenants)

    def tenant_of(self, authorization: str) -> str | None:
        """The tenant of an ``Authorization: Bearer <key>`` header's key; None when it
        names none (no key, a wrong key). Without keys: the default tenant."""
        if not self.required:
            return self.default
        if not authorization.startswith("Bearer "):
            return None
        return self._tenants.get(_digest(authorization[7:].strip().encode()))


def request_tenant(base: str, salt: str) -> str:
    """The tenant of a request of ``base`` (its key's tenant) that sent ``salt``
    (vLLM's cache_salt; "" none). ValueError when the two are longer than a tenant
    may be."""
    tenant = f"{base}/{salt}" if base and salt else base or salt
    if len(tenant) > MAX_TENANT_CHARS:
        raise ValueError(f"'cache_salt' may be at most {MAX_TENANT_CHARS - len(base) - 1} "
                         f"characters for this API key's tenant")
    return tenant
