"""API keys, stored hashed: the keys file never holds a usable secret.

A key is 32 random bytes (``sk-lc-…``), so a plain SHA-256 is enough to store it (the way GitHub and
Stripe store tokens): there is no low-entropy password to brute-force, and verification stays cheap on
every request. Comparison is constant-time. The file is written atomically with mode 0600.

File format (JSON)::

    {"keys": [{"name": "alice", "sha256": "…", "admin": false,
               "requests_per_minute": 600, "tokens_per_minute": 200000}]}
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from artifacts.common.atomic import atomic_write_json
from artifacts.errors import ConfigError

KEY_PREFIX = "sk-lc-"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    admin: bool = False
    requests_per_minute: float | None = None  # None: the gateway's default
    tokens_per_minute: float | None = None


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyStore:
    """The keys of one keys file, indexed by hash for a constant-time lookup per request."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = list(keys)
        self._by_hash = {k.sha256: k for k in self.keys}

    @classmethod
    def load(cls, path: str | Path) -> KeyStore:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: keys file not found (create one with `lifecycle gateway-keys add`)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            keys = [ApiKey(**entry) for entry in raw.get("keys", [])]
        except (json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path}: not a keys file ({exc})") from None
        for key in keys:
            if not re.fullmatch(r"[0-9a-f]{64}", key.sha256):
                raise ConfigError(f"{path}: key {key.name!r}: sha256 must be 64 hex digits")
        return cls(keys)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, {"keys": [asdict(k) for k in self.keys]}, mode=0o600)

    def add(self, name: str, *, admin: bool = False, requests_per_minute: float | None = None,
            tokens_per_minute: float | None = None) -> str:
        """Create a key named ``name`` and return its secret (shown once, stored only as a hash)."""
        if not _NAME_RE.match(name):
            raise ConfigError(f"key name {name!r}: use 1-64 letters, digits, '.', '_', '@' or '-'")
        if any(k.name == name for k in self.keys):
            raise ConfigError(f"key name {name!r} already exists; revoke it first")
        secret = new_secret()
        key = ApiKey(name, hash_key(secret), admin, requests_per_minute, tokens_per_minute)
        self.keys.append(key)
        self._by_hash[key.sha256] = key
        return secret

    def revoke(self, name: str) -> None:
        before = len(self.keys)
        self.keys = [k for k in self.keys if k.name != name]
        if len(self.keys) == before:
            raise ConfigError(f"no key named {name!r}")
        self._by_hash = {k.sha256: k for k in self.keys}

    def verify(self, secret: str) -> ApiKey | None:
        digest = hash_key(secret)
        key = self._by_hash.get(digest)
        # dict lookup by hash leaks nothing useful (the hash of a guess), but compare in constant time anyway
        if key is not None and hmac.compare_digest(key.sha256, digest):
            return key
        return None
