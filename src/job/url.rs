//! A job's own URL (`x-redisched-url`, REST and CLI `url`): untrusted input from a
//! producer, so the rules are strict and applied to what will actually be requested.
//!
//! - [`parse`] reads it with the WHATWG rules (the `url` crate, as the HTTP client
//!   does) and refuses what hides a different request behind the text: userinfo, a
//!   fragment, a backslash, control characters or spaces, a percent-encoded `.`, `/` or
//!   `\` in the path, any scheme but `http` and `https`.
//! - [`under_prefix`] compares the *normalised* URL (dot segments resolved, host
//!   lower-cased, default port dropped) with an allowed prefix by scheme, host, port and
//!   whole path segments, so `…/peruser/../evil` can never pass as `…/peruser/`.
//! - [`forbidden_address`] is the address rule: which IP addresses a job's URL may not
//!   reach (loopback, private, link-local, CGNAT, … and v6 forms carrying them). A
//!   literal address is checked here; a name is checked on each address it resolves
//!   to, when the connection is made (`dispatch/webhook/resolve.rs`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use url::{Host, Url};

/// Longer URLs are refused: no receiver needs one, and the URL is stored with the job.
pub const MAX_URL_BYTES: usize = 2048;

/// Parses a job's URL; `Err` says, in the producer's terms, what is wrong with it.
pub fn parse(raw: &str) -> Result<Url, String> {
    if raw.len() > MAX_URL_BYTES {
        return Err(format!(
            "URL is {} bytes long; at most {MAX_URL_BYTES} are accepted",
            raw.len()
        ));
    }
    if raw.contains('\\') {
        return Err(format!("URL {raw:?} contains a backslash"));
    }
    if raw.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "URL {raw:?} contains a space or a control character"
        ));
    }
    let url = Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("URL {raw:?} is not an http:// or https:// URL"));
    }
    if url.host().is_none() {
        return Err(format!("URL {raw:?} names no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!("URL {raw:?} carries a user name or password"));
    }
    if url.fragment().is_some() {
        return Err(format!("URL {raw:?} has a fragment (`#…`)"));
    }
    if let Some(encoded) = encoded_separator(raw_path(raw)) {
        return Err(format!(
            "URL {raw:?} percent-encodes {encoded} in its path, which could reach another path"
        ));
    }
    Ok(url)
}

/// The path of a raw absolute URL as written: after the authority, before `?` or `#`.
fn raw_path(raw: &str) -> &str {
    let after_scheme = raw.find("//").map_or(raw, |i| &raw[i + 2..]);
    let path = after_scheme.find('/').map_or("", |i| &after_scheme[i..]);
    path.split(['?', '#']).next().unwrap_or("")
}

/// `%2e`, `%2f` or `%5c` (any case) in `path`: what a server may decode into a dot
/// segment or a separator after the guard looked.
fn encoded_separator(path: &str) -> Option<&'static str> {
    let lower = path.to_ascii_lowercase();
    [("%2e", "`.`"), ("%2f", "`/`"), ("%5c", "`\\`")]
        .into_iter()
        .find(|(code, _)| lower.contains(code))
        .map(|(_, what)| what)
}

/// Whether the normalised `url` lies under `prefix` (itself parsed by [`parse`] and
/// ending in `/`): same scheme, host and port, and the prefix's path segments are the
/// first of the URL's.
pub fn under_prefix(url: &Url, prefix: &Url) -> bool {
    if url.scheme() != prefix.scheme()
        || url.host() != prefix.host()
        || url.port_or_known_default() != prefix.port_or_known_default()
    {
        return false;
    }
    let (Some(mut have), Some(want)) = (url.path_segments(), prefix.path_segments()) else {
        return false;
    };
    // `/peruser/` is the segments `peruser` and `` (what follows the slash).
    let want: Vec<&str> = want.collect();
    let (_, dirs) = want.split_last().unwrap_or((&"", &[]));
    dirs.iter().all(|dir| have.next() == Some(dir)) && have.next().is_some()
}

/// Why a job's URL may not reach `ip` (`None`: a global address it may reach).
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// The literal address in a URL's host, if it is one and is forbidden.
pub fn forbidden_host(url: &Url) -> Option<(IpAddr, &'static str)> {
    let ip = match url.host()? {
        Host::Ipv4(v4) => IpAddr::V4(v4),
        Host::Ipv6(v6) => IpAddr::V6(v6),
        Host::Domain(_) => return None,
    };
    forbidden_address(ip).map(|why| (ip, why))
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, _, _) => "an unspecified (0.0.0.0/8) address",
        (127, _, _) => "a loopback address",
        (10, _, _) | (192, 168, _) => "a private (RFC 1918) address",
        (172, 16..=31, _) => "a private (RFC 1918) address",
        (169, 254, _) => "a link-local address",
        (100, 64..=127, _) => "a shared (CGNAT, RFC 6598) address",
        (192, 0, 0) => "an IETF protocol assignment (192.0.0.0/24)",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "a documentation address",
        (198, 18..=19, _) => "a benchmarking address (198.18.0.0/15)",
        (192, 88, 99) => "a 6to4 relay anycast address",
        (224..=239, _, _) => "a multicast address",
        (240..=255, _, _) => "a reserved or broadcast address",
        _ => return None,
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_unspecified() {
        return Some("the unspecified address (::)");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    // Forms that carry an IPv4 address: judged by the address they carry.
    let carried = match s {
        // IPv4-mapped (::ffff:a.b.c.d) and the deprecated IPv4-compatible (::a.b.c.d).
        [0, 0, 0, 0, 0, 0xffff | 0, hi, lo] => Some((hi, lo)),
        // NAT64, the well-known prefix (64:ff9b::/96).
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => Some((hi, lo)),
        // 6to4 (2002:a.b.c.d::/48).
        [0x2002, hi, lo, ..] => Some((hi, lo)),
        _ => None,
    };
    if let Some((hi, lo)) = carried {
        let v4 = Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
        return forbidden_v4(v4).map(|_| "an IPv6 address carrying a forbidden IPv4 address");
    }
    Some(match s[0] {
        // Local-use NAT64 (64:ff9b:1::/48): translates to whatever the network chose.
        0x64 if s[1] == 0xff9b => "a local-use NAT64 address",
        0x100 if s[1..4] == [0, 0, 0] => "a discard-only address (100::/64)",
        // Teredo (2001::/32) hides the client's IPv4 address; documentation 2001:db8::/32.
        0x2001 if s[1] == 0 => "a Teredo address",
        0x2001 if s[1] == 0xdb8 => "a documentation address",
        x if x & 0xfe00 == 0xfc00 => "a unique local (fc00::/7) address",
        x if x & 0xffc0 == 0xfe80 => "a link-local address",
        x if x & 0xffc0 == 0xfec0 => "a site-local address",
        x if x & 0xff00 == 0xff00 => "a multicast address",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(p: &str) -> Url {
        parse(p).expect("a valid prefix")
    }

    /// The dot-segment family of the reported hole, and its relatives: each refused
    /// with a reason or, once normalised, no longer under the prefix.
    #[test]
    fn no_url_outside_the_prefix_passes() {
        let allowed = prefix("http://127.0.0.1:17611/peruser/");
        let outside = [
            "http://127.0.0.1:17611/peruser/../evil/dotdot",
            "http://127.0.0.1:17611/peruser/%2e%2e/evil/a1",
            "http://127.0.0.1:17611/peruser/%2E%2e/evil/a2",
            "http://127.0.0.1:17611/peruser/%2e./evil/a3",
            "http://127.0.0.1:17611/peruser/./../evil/a4",
            "http://127.0.0.1:17611/peruser/..%2fevil",
            "http://127.0.0.1:17611/peruser/..%5cevil",
            "http://127.0.0.1:17611/peruser\\..\\evil",
            "http://127.0.0.1:17611/peruser/\\../evil",
            "http://127.0.0.1:17611@evil.example/peruser/x",
            "http://user:pw@127.0.0.1:17611/peruser/x",
            "http://127.0.0.1:17611/peruser/x#frag",
            "http://127.0.0.1:17611/peruser/x#",
            "http://127.0.0.1:17611/peruser",
            "http://127.0.0.1:17611/peruserx/y",
            "http://127.0.0.1:17612/peruser/x",
            "https://127.0.0.1:17611/peruser/x",
            "http://127.0.0.2:17611/peruser/x",
            "http://127.0.0.1:17611/pe\truser/x",
            "http://127.0.0.1:17611/peruser/x y",
            "ftp://127.0.0.1:17611/peruser/x",
            "http://127.0.0.1:17611/other/peruser/x",
        ];
        for raw in outside {
            let passed = parse(raw).is_ok_and(|u| under_prefix(&u, &allowed));
            assert!(!passed, "{raw} passed the guard");
        }
    }

    #[test]
    fn normalised_forms_under_the_prefix_pass_as_what_is_requested() {
        let allowed = prefix("https://Hooks.Example.com:443/peruser/");
        for (raw, requested) in [
            (
                "https://hooks.example.com/peruser/a",
                "https://hooks.example.com/peruser/a",
            ),
            (
                "HTTPS://HOOKS.example.COM:443/peruser/a?x=1",
                "https://hooks.example.com/peruser/a?x=1",
            ),
            (
                "https://hooks.example.com/peruser/./a/../b",
                "https://hooks.example.com/peruser/b",
            ),
            (
                "https://hooks.example.com/peruser/",
                "https://hooks.example.com/peruser/",
            ),
            (
                "https://hooks.example.com/peruser/a?next=%2e%2e%2f",
                "https://hooks.example.com/peruser/a?next=%2e%2e%2f",
            ),
        ] {
            let url = parse(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert!(under_prefix(&url, &allowed), "{raw} refused");
            assert_eq!(url.as_str(), requested);
        }
    }

    #[test]
    fn a_root_prefix_admits_any_path_on_its_origin_only() {
        let allowed = prefix("https://hooks.example.com/");
        assert!(under_prefix(
            &prefix("https://hooks.example.com/a/b"),
            &allowed
        ));
        assert!(!under_prefix(
            &prefix("https://hooks.example.com.evil.org/a"),
            &allowed
        ));
    }

    #[test]
    fn refusals_name_the_cause() {
        let reason = |raw: &str| parse(raw).err().unwrap_or_default();
        assert!(reason("http://u@h/x").contains("user name"));
        assert!(reason("http://h/x#f").contains("fragment"));
        assert!(reason("http://h/a\\b").contains("backslash"));
        assert!(reason("http://h/%2E%2e/x").contains("percent-encodes `.`"));
        assert!(reason("file:///etc/passwd").contains("http://"));
        assert!(reason(&format!("http://h/{}", "a".repeat(MAX_URL_BYTES))).contains("bytes"));
    }

    /// The address table: every case Svix's and Hook0's guards list, and more.
    #[test]
    fn the_address_rule_case_by_case() {
        let forbidden = [
            "0.0.0.0",
            "0.1.2.3",
            "127.0.0.1",
            "127.255.255.254",
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "192.0.0.8",
            "192.0.2.1",
            "198.18.0.1",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::10.0.0.1",
            "64:ff9b::127.0.0.1",
            "64:ff9b:1::1",
            "2002:7f00:1::",
            "2002:a00:1::1",
            "2002:c0a8:101::",
            "2001::1",
            "2001:db8::1",
            "100::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "ff02::1",
        ];
        for text in forbidden {
            let ip: IpAddr = text.parse().expect(text);
            assert!(forbidden_address(ip).is_some(), "{text} was allowed");
        }
        let global = [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.216.34",
            "100.63.255.255",
            "100.128.0.1",
            "172.15.255.255",
            "172.32.0.1",
            "169.253.0.1",
            "192.0.1.1",
            "198.17.0.1",
            "223.255.255.255",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "2606:4700:4700::1111",
            "2a00:1450:4001::200e",
        ];
        for text in global {
            let ip: IpAddr = text.parse().expect(text);
            assert_eq!(forbidden_address(ip), None, "{text} was refused");
        }
    }

    #[test]
    fn literal_hosts_are_judged_in_their_normalised_form() {
        for raw in [
            "http://127.1/x",
            "http://2130706433/x",
            "http://0x7f.0.0.1/x",
            "http://[::ffff:7f00:1]/x",
            "http://[0:0:0:0:0:0:0:1]/x",
            "http://0/x",
        ] {
            let url = parse(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert!(forbidden_host(&url).is_some(), "{raw} was allowed");
        }
        assert!(forbidden_host(&prefix("http://8.8.8.8/x")).is_none());
        assert!(
            forbidden_host(&prefix("http://localhost/x")).is_none(),
            "names resolve later"
        );
    }
}
