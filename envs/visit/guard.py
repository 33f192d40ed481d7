"""SSRF guard: the visit tool must never reach the machine it runs on or its private network.

Rollout workers run next to Redis, Ray, vLLM and cloud metadata services. A model that writes
``visit(url="http://169.254.169.254/...")`` or a page that redirects to ``http://10.0.0.1/`` would
otherwise read them. The guard decides per URL (and per redirect hop, and per request a rendered page
makes) whether the host is public: every address the host resolves to must be a global unicast
address, including the IPv4 address hidden inside IPv4-mapped, IPv4-compatible, 6to4, Teredo and
NAT64 IPv6 forms, and including IPv4 literals written as integers or in octal/hex parts
("2130706433", "0x7f.1"), which ``getaddrinfo`` and browsers accept.

``allow_hosts`` opens holes on purpose (the local corpus server on 127.0.0.1): entries are host names
("corpus.local"), host:port pairs ("127.0.0.1:8080", "[::1]:9000") or networks in CIDR form
("10.1.0.0/16"). An allowed host skips every other check.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from turnstile.envs.tools.base import ToolError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> addresses as strings``; raises ``OSError`` when the name does not resolve."""

METADATA_HOSTNAMES = (
    "metadata",
    "metadata.google.internal",
    "metadata.goog",
    "metadata.azure.internal",
    "instance-data",
    "instance-data.ec2.internal",
)

# Addresses whose is_global is True in some Python versions but which cloud providers use for
# metadata, plus shared-address space that ``is_private`` misses in older Pythons.
_ALWAYS_BLOCKED: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/8"),
    ipaddress.ip_network("100.64.0.0/10"),
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("192.0.0.0/24"),
    ipaddress.ip_network("198.18.0.0/15"),
    ipaddress.ip_network("fd00:ec2::254/128"),
    ipaddress.ip_network("fc00::/7"),
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("ff00::/8"),
)
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


@dataclass
class GuardConfig:
    """Which hosts the visit tool may reach besides public internet addresses."""

    allow_hosts: list[str] = field(default_factory=list)
    blocked_hostnames: list[str] = field(default_factory=lambda: list(METADATA_HOSTNAMES))


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve with the event loop's ``getaddrinfo`` (all families, TCP)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def parse_ipv4_literal(host: str) -> ipaddress.IPv4Address | None:
    """Parse the IPv4 spellings ``inet_aton`` accepts: 1 to 4 parts, each decimal, octal or hex.

    "2130706433", "0x7f.1", "0177.0.0.1" and "127.1" all mean 127.0.0.1 to getaddrinfo and to
    browsers, so they must mean it to the guard too. Returns None when ``host`` is not such a literal.
    """
    parts = host.split(".")
    if parts and parts[-1] == "":
        parts = parts[:-1]  # a trailing dot is allowed
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for part in parts:
        try:
            if part.lower().startswith("0x"):
                values.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                values.append(int(part, 8))
            else:
                if not part.isdigit():
                    return None
                values.append(int(part, 10))
        except ValueError:
            return None
    # The last part fills all remaining bytes: a.b.c.d, a.b.(16 bits), a.(24 bits), (32 bits).
    last_bits = 8 * (5 - len(values))
    if any(value > 255 for value in values[:-1]) or values[-1] >= 1 << last_bits:
        return None
    number = values[-1]
    for index, value in enumerate(values[:-1]):
        number |= value << (24 - 8 * index)
    return ipaddress.IPv4Address(number)


def parse_ip_literal(host: str) -> IPAddress | None:
    """An IP address written in ``host`` (IPv6 with or without brackets, any IPv4 spelling)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(bare.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return parse_ipv4_literal(bare)


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, 6to4, Teredo, NAT64), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    packed = int(address)
    if any(address in network for network in _NAT64):
        return ipaddress.IPv4Address(packed & 0xFFFFFFFF)
    if address in _IPV4_COMPATIBLE and packed > 1:  # ::/96 minus :: and ::1
        return ipaddress.IPv4Address(packed & 0xFFFFFFFF)
    return None


def blocked_reason(address: IPAddress) -> str | None:
    """Why ``address`` must not be reached, or None when it is a public unicast address."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None:
            reason = blocked_reason(inner)
            return f"embeds {inner}, which {reason}" if reason else None
    for network in _ALWAYS_BLOCKED:
        if address.version == network.version and address in network:
            return f"is in the non-public range {network}"
    checks = (
        ("is_loopback", "is a loopback address"),
        ("is_unspecified", "is the unspecified address"),
        ("is_link_local", "is link-local"),
        ("is_multicast", "is multicast"),
        ("is_private", "is a private address"),
        ("is_reserved", "is reserved"),
    )
    for attribute, reason in checks:
        if getattr(address, attribute):
            return reason
    if not address.is_global:
        return "is not a global address"
    return None


@dataclass(frozen=True)
class _AllowEntry:
    host: str | None = None
    port: int | None = None
    network: IPNetwork | None = None


def _parse_allow_entry(entry: str) -> _AllowEntry:
    text = entry.strip().lower()
    if "/" in text:
        try:
            return _AllowEntry(network=ipaddress.ip_network(text, strict=False))
        except ValueError as error:
            raise ValueError(f"allow_hosts entry {entry!r} is not a valid CIDR network: {error}") from None
    if text.startswith("["):  # [v6] or [v6]:port
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else None
        return _AllowEntry(host=host, port=port)
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if not port_text.isdigit():
            raise ValueError(f"allow_hosts entry {entry!r}: the port after ':' must be a number")
        return _AllowEntry(host=host, port=int(port_text))
    return _AllowEntry(host=text)


def _normal_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _blocked(host: str, why: str) -> ToolError:
    return ToolError(
        "blocked",
        f"refused to visit host {host!r}: {why}. Only public internet addresses may be visited; "
        f"to allow this host on purpose add {host!r} (or host:port, or a CIDR) to "
        f"visit.guard.allow_hosts",
    )


class SsrfGuard:
    """Checks URLs and resolved addresses against the public-internet rule and the allow-list."""

    def __init__(self, config: GuardConfig | None = None, resolver: Resolver | None = None) -> None:
        self.config = config or GuardConfig()
        self._resolve = resolver or system_resolver
        self._allow = [_parse_allow_entry(entry) for entry in self.config.allow_hosts]
        self._blocked_names = {_normal_host(name) for name in self.config.blocked_hostnames}

    def is_allow_listed(self, host: str, port: int | None) -> bool:
        """True when ``host`` (and ``port``) match an ``allow_hosts`` entry."""
        name = _normal_host(host)
        literal = parse_ip_literal(name)
        for entry in self._allow:
            if entry.network is not None:
                if literal is not None and literal.version == entry.network.version \
                        and literal in entry.network:
                    return True
                continue
            same_host = entry.host == name or (
                literal is not None and parse_ip_literal(entry.host or "") == literal)
            if same_host and (entry.port is None or entry.port == port):
                return True
        return False

    async def check_url(self, url: str) -> None:
        """Raise ``ToolError("blocked")`` unless ``url`` is http(s) and its host may be reached."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise ToolError("blocked", f"refused to visit {url!r}: only http and https URLs can be "
                                       f"visited, not {parts.scheme or 'a URL without scheme'!r}")
        try:
            host, port = parts.hostname, parts.port
        except ValueError as error:  # a port that is not a number
            raise ToolError("bad_arguments", f"cannot visit {url!r}: {error}; fix the URL") from None
        if not host:
            raise ToolError("bad_arguments", f"cannot visit {url!r}: the URL has no host; "
                                             f"write a full URL such as https://example.com/page")
        default_port = 443 if parts.scheme.lower() == "https" else 80
        await self.check_host(host, port or default_port)

    async def check_host(self, host: str, port: int) -> list[IPAddress]:
        """Resolve ``host`` and return its addresses if all may be reached, else raise ``blocked``.

        For an allow-listed host the result is empty: the caller connects by name as usual.
        """
        if self.is_allow_listed(host, port):
            return []
        name = _normal_host(host)
        if name in self._blocked_names:
            raise _blocked(host, "it is a cloud metadata service name")
        literal = parse_ip_literal(name)
        if literal is not None:
            addresses: list[IPAddress] = [literal]
        else:
            try:
                resolved = await self._resolve(name, port)
            except (OSError, UnicodeError) as error:  # UnicodeError: an empty or over-long label
                raise ToolError("dns", f"cannot resolve host {host!r}: {error}; check the URL's "
                                       f"spelling", retryable=True) from None
            addresses = [parse_ip_literal(text) or _unparseable(host, text) for text in resolved]
            if not addresses:
                raise ToolError("dns", f"host {host!r} resolved to no address; check the URL",
                                retryable=True)
        for address in addresses:
            if self._address_allow_listed(address, port):
                continue
            reason = blocked_reason(address)
            if reason is not None:
                why = f"{address} {reason}" if literal is not None else \
                    f"it resolves to {address}, which {reason}"
                raise _blocked(host, why)
        return addresses

    def _address_allow_listed(self, address: IPAddress, port: int) -> bool:
        return self.is_allow_listed(str(address), port)


def _unparseable(host: str, text: str) -> IPAddress:
    raise ToolError("blocked", f"refused to visit host {host!r}: the resolver returned {text!r}, "
                               f"which is not an IP address")

