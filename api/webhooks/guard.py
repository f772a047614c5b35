"""The target guard: a webhook may not be pointed at the service's own network.

A subscription's URL is refused when its host resolves to a loopback, private, shared
(carrier-grade NAT), link-local (which holds the cloud metadata address 169.254.169.254),
multicast, reserved or unspecified address — unless the operator allow-lists it
(``FOREWARN_WEBHOOK_ALLOW``: comma-separated host names and IP networks, e.g.
``127.0.0.1,10.0.0.0/8,hooks.internal``). In ``production`` plain ``http`` is refused too,
unless the host is allow-listed.

The check runs when a subscription is created or changed, and again at every delivery: the
host is resolved, every address it resolves to must pass, and the connection is then made to
the checked address itself (the request keeps the name in ``Host`` and TLS SNI), so a DNS
answer that changes between check and connect (rebinding) cannot redirect it. Redirects are
never followed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from forewarn.errors import InvalidInput

__all__ = ["PinnedTarget", "TargetGuard", "TargetRefused"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data"})
_EXTRA_BLOCKED: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("100.64.0.0/10"),  # shared address space (Alibaba metadata lives here)
    ipaddress.ip_network("fd00:ec2::254/128"),  # AWS metadata over IPv6
    ipaddress.ip_network("192.0.0.0/24"),
)


class TargetRefused(InvalidInput):
    """The URL points where webhooks may not go (or cannot be resolved)."""

    code = "webhook_target_refused"


@dataclass(frozen=True)
class PinnedTarget:
    """A checked destination: connect to ``ip``, send ``host`` as Host and TLS SNI."""

    url: str
    scheme: str
    host: str
    port: int
    ip: str

    def connect_url(self) -> str:
        """``url`` with the host replaced by the checked address."""
        parts = urlsplit(self.url)
        literal = f"[{self.ip}]" if ":" in self.ip else self.ip
        netloc = f"{literal}:{self.port}"
        path = parts.path or "/"
        return f"{parts.scheme}://{netloc}{path}" + (f"?{parts.query}" if parts.query else "")

    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def _blocked_reason(ip: IPAddress) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for name in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    if any(ip in net for net in _EXTRA_BLOCKED if net.version == ip.version):
        return "internal"
    return None


class TargetGuard:
    """Checks webhook targets.

    Args:
        allow: allow-listed host names and IP networks (``FOREWARN_WEBHOOK_ALLOW``).
        require_https: refuse ``http`` unless the host is allow-listed (production).
        resolve_timeout_s: how long a DNS lookup may take.
    """

    def __init__(
        self, allow: str | list[str] = "", *, require_https: bool, resolve_timeout_s: float = 5.0
    ) -> None:
        entries = allow.split(",") if isinstance(allow, str) else allow
        self.hosts: set[str] = set()
        self.networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.hosts.add(entry)
        self.require_https = require_https
        self.resolve_timeout_s = resolve_timeout_s

    def _ip_allowed(self, ip: IPAddress) -> bool:
        return any(ip in net for net in self.networks if net.version == ip.version)

    def check_url(self, url: str) -> tuple[str, str, int]:
        """Scheme, host and port of ``url`` if its form is acceptable (no DNS)."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise TargetRefused(f"not a valid URL: {exc}") from None
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
        if scheme not in ("http", "https") or not host:
            raise TargetRefused("the URL must be http(s)://host/...")
        if parts.username or parts.password:
            raise TargetRefused("credentials in the URL are not accepted; sign with the secret")
        if scheme == "http" and self.require_https and host not in self.hosts:
            literal = _literal(host)
            if literal is None or not self._ip_allowed(literal):
                raise TargetRefused("production requires https (or an allow-listed host)")
        if host in _METADATA_HOSTS and host not in self.hosts:
            raise TargetRefused(f"{host} is a cloud metadata endpoint")
        return scheme, host, port or (443 if scheme == "https" else 80)

    async def resolve(self, url: str) -> PinnedTarget:
        """Check ``url``, resolve its host and return the address to connect to.

        Raises:
            TargetRefused: the form is wrong, the host does not resolve, or an address it
                resolves to is internal and not allow-listed.
        """
        scheme, host, port = self.check_url(url)
        literal = _literal(host)
        if literal is not None:
            addresses: list[IPAddress] = [literal]
        else:
            loop = asyncio.get_running_loop()
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM),
                    self.resolve_timeout_s,
                )
            except (OSError, TimeoutError) as exc:
                raise TargetRefused(f"cannot resolve {host}: {exc}") from None
            addresses = list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))
            if not addresses:
                raise TargetRefused(f"{host} resolves to no address")
        if host not in self.hosts:
            for ip in addresses:
                reason = _blocked_reason(ip)
                if reason is not None and not self._ip_allowed(ip):
                    raise TargetRefused(
                        f"{host} resolves to {ip}, a {reason} address; allow-list it with "
                        "FOREWARN_WEBHOOK_ALLOW to deliver there",
                        details={"host": host, "address": str(ip), "kind": reason},
                    )
        return PinnedTarget(url=url, scheme=scheme, host=host, port=port, ip=str(addresses[0]))


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
