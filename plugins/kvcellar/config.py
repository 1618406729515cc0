"""Where the cluster is and how to talk to it: one set of keys for the
:class:`~kvcellar.Client`, both plugins and ``kvctl``.

Each key has an environment variable that fills it when the caller's own
configuration leaves it out:

============== ============================ =========================================
key            environment variable         value
============== ============================ =========================================
``mds``        ``KVCELLAR_MDS``             kv-mds endpoints, ``host:port,...``
``group``      ``KVCELLAR_GROUP``           group name (default ``default``)
``members``    ``KVCELLAR_MEMBERS``         static members ``id=host:port[@w],...``
``auth_token_file`` ``KVCELLAR_AUTH_TOKEN_FILE`` path of the group's token
``options``    ``KVCELLAR_OPTIONS``         client options ``key=value,...``
============== ============================ =========================================

``mds`` and ``members`` are one choice (discovery or a static list): if the
configuration names either, the environment's are not used for either; the
same level naming both is an error that names both.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Union

ENV_VARS: Dict[str, str] = {
    "mds": "KVCELLAR_MDS",
    "group": "KVCELLAR_GROUP",
    "members": "KVCELLAR_MEMBERS",
    "auth_token_file": "KVCELLAR_AUTH_TOKEN_FILE",
    "options": "KVCELLAR_OPTIONS",
}

NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_NAME = NAME
_ENDPOINT = re.compile(r"^[^\s,:]+:\d{1,5}$|^\[[0-9A-Fa-f:.]+\]:\d{1,5}$")
_OPTION_KEY = re.compile(r"^[a-z_]+$")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key."""


@dataclass
class Settings:
    """Resolved cluster settings (see the module docs)."""

    mds: Optional[List[str]] = None
    group: str = "default"
    members: Optional[str] = None
    auth_token_file: Optional[str] = None
    options: Dict[str, str] = field(default_factory=dict)

    def options_string(self) -> str:
        """The C ABI's ``key=value,...`` form, the token file included."""
        opts = dict(self.options)
        if self.auth_token_file:
            opts["auth_token_file"] = self.auth_token_file
        return ",".join(f"{k}={v}" for k, v in opts.items())


def identity_hash(namespace: str, identity: Mapping[str, Any]) -> int:
    """A u64 digest of an identity (the plugins' ``model_hash``)."""
    text = namespace + "|" + json.dumps(identity, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name, "").strip()
    return v or None


def parse_mds(value: Union[str, List[str]], key: str = "mds") -> List[str]:
    """``"h:p,h:p"`` or a list of ``"h:p"`` -> a list of endpoints."""
    items = value.split(",") if isinstance(value, str) else list(value)
    eps = [str(e).strip() for e in items if str(e).strip()]
    if not eps:
        raise ConfigError(f"{key}: no endpoint given (expected host:port,...)")
    for e in eps:
        if not _ENDPOINT.match(e) or not 0 < int(e.rsplit(":", 1)[1]) < 65536:
            raise ConfigError(f"{key}: {e!r} is not host:port")
    return eps


def parse_members(value: Union[str, List[str], Mapping[str, str]], key: str = "members") -> str:
    """A member list in the C ABI's ``id=host:port[@weight],...`` form.

    Accepts that string, a list of ``id=host:port[@weight]`` items, or a
    mapping ``{id: "host:port[@weight]"}``. The library checks addresses.
    """
    if isinstance(value, Mapping):
        items = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, str):
        items = [s.strip() for s in value.split(",") if s.strip()]
    else:
        items = [str(s).strip() for s in value]
    if not items:
        raise ConfigError(f"{key}: the member list is empty")
    for it in items:
        ident, sep, addr = it.partition("=")
        if not sep or not _NAME.match(ident) or ":" not in addr:
            raise ConfigError(f"{key}: {it!r} is not id=host:port[@weight]")
    return ",".join(items)


def parse_options(value: Union[str, Mapping[str, Any]], key: str = "options") -> Dict[str, str]:
    """``"k=v,k=v"`` or a mapping -> {key: value as text}."""
    if isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = []
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            k, sep, v = part.partition("=")
            if not sep:
                raise ConfigError(f"{key}: {part!r} is not key=value")
            pairs.append((k.strip(), v.strip()))
    out: Dict[str, str] = {}
    for k, v in pairs:
        if not _OPTION_KEY.match(k):
            raise ConfigError(f"{key}: {k!r} is not an option name")
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ConfigError(f"{key}: {k} must be an integer or text, not {type(v).__name__}")
        out[k] = str(v)
    return out


def resolve(config: Optional[Mapping[str, Any]] = None, where: str = "config") -> Settings:
    """Settings from ``config`` (keys of :data:`ENV_VARS`), the environment
    filling what it leaves out. ``where`` prefixes error messages (e.g. the
    plugin's name for its extra-config)."""
    cfg = {k: v for k, v in (config or {}).items() if v is not None and v != ""}
    s = Settings()
    mds, members = cfg.get("mds"), cfg.get("members")
    level = where
    if mds is None and members is None:
        mds, members = _env(ENV_VARS["mds"]), _env(ENV_VARS["members"])
        level = "environment"
        if mds is not None and members is not None:
            raise ConfigError(f"{ENV_VARS['mds']} and {ENV_VARS['members']} are both set: keep one")
    elif mds is not None and members is not None:
        raise ConfigError(f"{where}: 'mds' and 'members' are both set: give one (discovery or a static list)")
    mds_key = "mds" if level == where else ENV_VARS["mds"]
    members_key = "members" if level == where else ENV_VARS["members"]
    if mds is not None:
        s.mds = parse_mds(mds, f"{where} key '{mds_key}'" if level == where else mds_key)
    if members is not None:
        s.members = parse_members(members, f"{where} key '{members_key}'" if level == where else members_key)
    group = cfg.get("group", _env(ENV_VARS["group"]))
    if group is not None:
        if not isinstance(group, str) or not _NAME.match(group):
            raise ConfigError(f"{where} key 'group': {group!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        s.group = group
    token = cfg.get("auth_token_file", _env(ENV_VARS["auth_token_file"]))
    if token is not None:
        token_key = f"{where} key 'auth_token_file'" if "auth_token_file" in cfg else ENV_VARS["auth_token_file"]
        if not isinstance(token, (str, os.PathLike)) or not str(token).strip():
            raise ConfigError(f"{token_key}: {token!r} is not a file path")
        token = str(token).strip()
        if "," in token:
            raise ConfigError(f"{token_key}: {token!r}: the path of the token file cannot contain a comma")
        if not os.path.isfile(token):
            raise ConfigError(f"{token_key}: no token file at {token!r}")
        s.auth_token_file = token
    opts = cfg.get("options", _env(ENV_VARS["options"]))
    if opts is not None:
        s.options = parse_options(opts, f"{where} key 'options'")
    return s


#: How long one discovery long-poll waits (ms). A change of the member set
#: answers a waiting long-poll at once, so a long wait costs no freshness;
#: it sets how often every engine process reconnects to kv-mds when nothing
#: changes (docs/DEPLOY.md, "Sizing the membership tier").
DEFAULT_POLL_MS = 30000

#: The cluster keys every engine plugin takes, and its timeout shortcuts.
CLUSTER_KEYS = ("mds", "group", "members", "auth_token_file", "options")
TIMEOUT_KEYS = ("io_timeout_ms", "connect_timeout_ms")


def positive_int(cfg: Mapping[str, Any], key: str, default: int, where: str) -> int:
    """``cfg[key]`` (or ``default``) as a positive integer, else a ConfigError naming the key."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{where} key '{key}': {v!r} must be a positive integer")
    return v


def plugin_settings(cfg: Mapping[str, Any], where: str) -> Settings:
    """An engine plugin's cluster settings: its cluster keys (the
    environment filling what they leave out), which must name a cluster,
    and the timeout shortcuts (milliseconds) folded into the options."""
    s = resolve({k: cfg.get(k) for k in CLUSTER_KEYS}, where=where)
    if s.mds is None and s.members is None:
        raise ConfigError(
            f"{where}: give 'mds' (kv-mds endpoints) and 'group', or 'members' "
            "(or set KVCELLAR_MDS / KVCELLAR_MEMBERS)"
        )
    for k in TIMEOUT_KEYS:
        if k in cfg:
            s.options[k] = str(positive_int(cfg, k, 0, where))
    return s


def tenant_prefix(tenant: Any, key: str) -> str:
    """A tenant's key prefix (``tenant/``), or "" without one."""
    if tenant is None:
        return ""
    if not isinstance(tenant, str) or not NAME.match(tenant):
        raise ConfigError(f"{key}: {tenant!r} must be 1-64 of A-Z a-z 0-9 . _ -")
    return f"{tenant}/"
