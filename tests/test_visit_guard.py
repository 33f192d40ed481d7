"""SSRF guard unit tests: address classes, literal spellings, resolution and the allow-list."""

from __future__ import annotations

import ipaddress

import pytest

from turnstile.envs.tools.base import ToolError
from turnstile.envs.visit.guard import GuardConfig, Resolver, SsrfGuard, blocked_reason, parse_ipv4_literal

PUBLIC = "93.184.216.34"


def fake_resolver(table: dict[str, list[str]]) -> Resolver:
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


async def assert_blocked(guard: SsrfGuard, url: str) -> ToolError:
    with pytest.raises(ToolError) as caught:
        await guard.check_url(url)
    assert caught.value.kind == "blocked", caught.value
    assert not caught.value.retryable
    assert "allow_hosts" in caught.value.message or "http and https" in caught.value.message
    return caught.value


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.1", "100.127.255.254",
    "169.254.169.254", "169.254.1.1", "0.0.0.0", "224.0.0.1", "240.0.0.1", "255.255.255.255",
    "::1", "::", "fc00::1", "fd12:3456::1", "fe80::1", "ff02::1", "fd00:ec2::254",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
    "2002:7f00:1::", "2002:a00:1::1", "64:ff9b::a00:1", "64:ff9b::7f00:1",
])
def test_non_public_addresses_are_blocked(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "64:ff9b::808:808"])
def test_public_addresses_pass(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(("spelling", "address"), [
    ("2130706433", "127.0.0.1"), ("0x7f.1", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"),
    ("127.1", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("10.1", "10.0.0.1"),
    ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"), ("1.2.3.4", "1.2.3.4"),
])
def test_ipv4_literal_spellings(spelling: str, address: str) -> None:
    assert parse_ipv4_literal(spelling) == ipaddress.IPv4Address(address)


@pytest.mark.parametrize("host", ["example.com", "256.1.1.1", "1e3", "1.2.3.4.5", ""])
def test_non_literals_are_not_parsed_as_ipv4(host: str) -> None:
    assert parse_ipv4_literal(host) is None


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/", "http://2130706433/", "http://0x7f.1/", "http://0177.0.0.1:8080/x",
    "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]/", "http://10.0.0.1/",
    "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/", "https://100.64.1.1/",
    "http://[fe80::1%25eth0]/",
])
async def test_literal_urls_blocked_without_dns(url: str) -> None:
    resolver = fake_resolver({})
    await assert_blocked(SsrfGuard(resolver=resolver), url)
    assert resolver.calls == []  # literals never reach DNS


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/", "gopher://x/",
                                 "javascript:alert(1)", "//example.com/"])
async def test_non_http_schemes_blocked(url: str) -> None:
    await assert_blocked(SsrfGuard(resolver=fake_resolver({})), url)


async def test_metadata_names_blocked_before_dns() -> None:
    resolver = fake_resolver({"metadata.google.internal": [PUBLIC]})
    error = await assert_blocked(SsrfGuard(resolver=resolver), "http://metadata.google.internal/x")
    assert "metadata.google.internal" in error.message
    assert resolver.calls == []


async def test_names_resolving_to_private_space_blocked() -> None:
    resolver = fake_resolver({"evil.test": ["10.1.2.3"], "sneaky.test": ["::ffff:192.168.0.1"]})
    guard = SsrfGuard(resolver=resolver)
    error = await assert_blocked(guard, "http://evil.test/")
    assert "evil.test" in error.message and "10.1.2.3" in error.message
    await assert_blocked(guard, "https://sneaky.test/")


async def test_all_resolved_addresses_must_be_public() -> None:
    resolver = fake_resolver({"mixed.test": [PUBLIC, "127.0.0.1"], "good.test": [PUBLIC, "8.8.8.8"]})
    guard = SsrfGuard(resolver=resolver)
    await assert_blocked(guard, "http://mixed.test/")
    await guard.check_url("http://good.test/page")


async def test_real_dns_localhost_is_blocked() -> None:
    await assert_blocked(SsrfGuard(), "http://localhost:8080/")


async def test_unresolvable_host_is_a_retryable_dns_error() -> None:
    with pytest.raises(ToolError) as caught:
        await SsrfGuard(resolver=fake_resolver({})).check_url("http://nowhere.test/")
    assert caught.value.kind == "dns" and caught.value.retryable


async def test_allow_list_host_port_cidr_and_name() -> None:
    resolver = fake_resolver({"corpus.local": ["127.0.0.1"], "intranet.test": ["10.1.2.3"]})
    guard = SsrfGuard(GuardConfig(allow_hosts=["127.0.0.1:8080", "[::1]:9000", "10.1.0.0/16",
                                               "corpus.local"]), resolver)
    await guard.check_url("http://127.0.0.1:8080/doc/1")
    await guard.check_url("http://[::1]:9000/")
    await guard.check_url("http://10.1.200.3/")
    await guard.check_url("http://intranet.test/")  # resolves into the allowed network
    await guard.check_url("http://corpus.local:1234/")
    await assert_blocked(guard, "http://127.0.0.1:8081/")  # same host, other port
    await assert_blocked(guard, "http://[::1]:9001/")
    await assert_blocked(guard, "http://10.2.0.1/")
    await assert_blocked(guard, "http://2130706433:8081/")


def test_bad_allow_list_entry_names_the_entry() -> None:
    with pytest.raises(ValueError, match=r"10.0.0.0/99"):
        SsrfGuard(GuardConfig(allow_hosts=["10.0.0.0/99"]))
