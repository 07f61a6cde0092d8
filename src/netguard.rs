//! The SSRF guard: which addresses zonewatch may open a connection to.
//!
//! Why it exists: webhook targets come from subscribers and feed URLs from operators' configs
//! (and from redirects a feed answers with). Left unguarded, either can point zonewatch at the
//! machine's own control port, a cloud metadata endpoint or the office network. Loopback,
//! private, link-local, CGNAT and unique-local addresses are refused unless the operator sets
//! `allow_private_targets`.
//!
//! The check runs where the address is chosen: [`GuardedResolver`] is the HTTP clients' DNS
//! resolver, so the addresses it checks are exactly the ones connected to. A check made before
//! the request with a lookup of its own would let a name that answers differently the second
//! time (DNS rebinding) through. Hosts written as IP literals are never resolved; callers check
//! them with [`Guard::check`] before sending (which also covers the case of a proxy, where the
//! resolver sees the proxy's name instead of the target's).

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use std::error::Error;
use std::net::{IpAddr, SocketAddr};

/// Loopback, private, link-local, unspecified ("this network", 0/8), broadcast and reserved
/// (240/4), CGNAT, benchmarking (198.18/15), unique-local or site-local addresses; also IPv4
/// ones written inside IPv6 (IPv4-mapped, IPv4-compatible, NAT64 `64:ff9b::/96`), which a
/// host may route to the IPv4 address.
pub fn is_private(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || o[0] == 0
                || o[0] >= 240
                || (o[0] == 100 && (64..128).contains(&o[1]))
                || (o[0] == 198 && (18..20).contains(&o[1]))
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            let embedded_v4 = || std::net::Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
            v6.is_loopback()
                || v6.is_unspecified()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
                || v6.to_ipv4_mapped().map(|v4| is_private(&IpAddr::V4(v4))).unwrap_or(false)
                // IPv4-compatible (`::a.b.c.d`, deprecated) and NAT64 (`64:ff9b::a.b.c.d`).
                || (s[..6] == [0; 6] && is_private(&IpAddr::V4(embedded_v4())))
                || (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] && is_private(&IpAddr::V4(embedded_v4())))
                // Local-use NAT64 (`64:ff9b:1::/48`, RFC 8215): never routed globally.
                || (s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1)
                // 6to4 (`2002:aabb:ccdd::`) of a private IPv4 address.
                || (s[0] == 0x2002 && is_private(&IpAddr::V4(std::net::Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8))))
        }
    }
}

/// The private address a host written as an IP literal names (`None` for a public literal or
/// a name, which [`GuardedResolver`] checks when it is resolved). Brackets of an IPv6 literal
/// are accepted.
pub fn literal_private(host: &str) -> Option<IpAddr> {
    host.trim_matches(['[', ']']).parse::<IpAddr>().ok().filter(is_private)
}

/// Whether a target's host is private as written, without a lookup: a private IP literal, or
/// `localhost` (and its subdomains, RFC 6761). `zonewatch check` refuses such targets while
/// `allow_private_targets` is false: every delivery to them would be refused.
pub fn written_private(host: &str) -> bool {
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    literal_private(host).is_some() || name == "localhost" || name.ends_with(".localhost")
}

/// Whether `url`'s host is private as written ([`written_private`]); false for a URL that
/// does not parse or has no host (the config check reports those).
pub fn url_written_private(url: &str) -> bool {
    reqwest::Url::parse(url).ok().and_then(|u| u.host_str().map(written_private)).unwrap_or(false)
}

/// A name that resolved to a private address: the connection was refused before it was made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{host} resolves to private address {ip}")]
pub struct PrivateAddress {
    pub host: String,
    pub ip: IpAddr,
}

/// The DNS resolver of zonewatch's HTTP clients when private targets are not allowed: resolves
/// with the system resolver and refuses the name if any of its addresses is private (a name
/// with one public and one private address could otherwise be steered to the private one).
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardedResolver;

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if let Some(a) = addrs.iter().find(|a| is_private(&a.ip())) {
                return Err(Box::new(PrivateAddress { host, ip: a.ip() }) as Box<dyn Error + Send + Sync>);
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// The environment variables reqwest takes a proxy from.
const PROXY_VARS: [&str; 6] = ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"];

/// Why a target was refused before a connection was opened.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Private(#[from] PrivateAddress),
    /// The lookup's own error is kept: one this process failed for want of its own
    /// resources (`EMFILE`) is not the target's (`local_failure` in `notify/delivery/client.rs`).
    #[error("cannot resolve {host}: {source}")]
    Dns { host: String, source: std::io::Error },
}

impl Refused {
    /// The failed lookup's own error, for a [`Refused::Dns`].
    pub(crate) fn lookup_error(&self) -> Option<&std::io::Error> {
        match self {
            Refused::Dns { source, .. } => Some(source),
            Refused::Private(_) => None,
        }
    }
}

/// One HTTP client's guard, decided when the client is built.
///
/// Without a proxy the guard is the client's resolver ([`GuardedResolver`]). Through a proxy
/// taken from the environment (`HTTP_PROXY` and friends, which reqwest honours) the client
/// resolves the proxy's name, not the target's, and a corporate proxy on a private address
/// is normal: then the guard falls back to resolving the target itself before each request,
/// which a rebinding answer can get past (the proxy does its own lookup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    allow_private_targets: bool,
    via_proxy: bool,
}

impl Guard {
    /// The guard for a client of this process (reads the proxy variables once).
    pub fn new(allow_private_targets: bool) -> Guard {
        let via_proxy = PROXY_VARS.iter().any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
        if via_proxy && !allow_private_targets {
            tracing::debug!("a proxy is set in the environment: private targets are checked by a lookup before each request");
        }
        Guard { allow_private_targets, via_proxy }
    }

    /// Installs [`GuardedResolver`] on a client builder when it is the guard.
    pub fn client(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        if self.allow_private_targets || self.via_proxy {
            builder
        } else {
            builder.dns_resolver(GuardedResolver)
        }
    }

    /// The check made before a request: a private IP literal is refused; through a proxy,
    /// so is a name that resolves to a private address now. Without a proxy names are left to
    /// the resolver, so this costs no lookup. The lookup takes at most `within` (the system's
    /// resolver can take half a minute with a few silent name servers), then fails as a name
    /// that does not resolve: a webhook's attempt is bounded by `delivery.timeout_ms` in all
    /// (a reviewer: its leases are sized on that).
    pub async fn check(&self, host: &str, port: u16, within: std::time::Duration) -> Result<(), Refused> {
        if self.allow_private_targets {
            return Ok(());
        }
        let host = host.trim_matches(['[', ']']);
        if let Some(ip) = literal_private(host) {
            return Err(PrivateAddress { host: host.to_string(), ip }.into());
        }
        if !self.via_proxy || host.parse::<IpAddr>().is_ok() {
            return Ok(());
        }
        let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {} ms", within.as_millis()));
        let addrs = match tokio::time::timeout(within, tokio::net::lookup_host((host, port))).await {
            Ok(found) => found.map_err(|source| Refused::Dns { host: host.to_string(), source })?,
            Err(_) => return Err(Refused::Dns { host: host.to_string(), source: timed_out() }),
        };
        for a in addrs {
            if is_private(&a.ip()) {
                return Err(PrivateAddress { host: host.to_string(), ip: a.ip() }.into());
            }
        }
        Ok(())
    }
}

/// The guard's refusal inside a failed request's error chain, if that is why it failed.
pub fn refusal<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a PrivateAddress> {
    let mut cur: Option<&'a (dyn Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(found) = e.downcast_ref::<PrivateAddress>() {
            return Some(found);
        }
        cur = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_addresses() {
        for ip in [
            "127.0.0.1", "10.1.2.3", "192.168.1.1", "169.254.1.1", "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1", "100.64.0.1",
            "0.1.2.3", "240.0.0.1", "255.255.255.255", "198.18.0.1", "198.19.255.1", "fec0::1", "::7f00:1", "::a9fe:a9fe", "64:ff9b::a9fe:a9fe",
            "64:ff9b::10.0.0.1", "64:ff9b:1::a9fe:a9fe", "64:ff9b:1::808:808", "2002:a9fe:a9fe::1", "2002:7f00:1::",
        ] {
            assert!(is_private(&ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "2001:4860::8888", "198.20.0.1", "64:ff9b::8.8.8.8", "::808:808", "223.255.255.255", "2002:808:808::1"] {
            assert!(!is_private(&ip.parse().unwrap()), "{ip}");
        }
        assert_eq!(literal_private("[::1]"), Some("::1".parse().unwrap()));
        assert_eq!(literal_private("8.8.8.8"), None);
        assert_eq!(literal_private("localhost"), None, "names are the resolver's to check");
        for host in ["127.0.0.1", "[::1]", "localhost", "LocalHost.", "api.localhost"] {
            assert!(written_private(host), "{host}");
        }
        for host in ["example.org", "8.8.8.8", "localhost.example.org"] {
            assert!(!written_private(host), "{host}");
        }
    }

    #[tokio::test]
    async fn the_pre_request_check() {
        let direct = Guard { allow_private_targets: false, via_proxy: false };
        assert!(matches!(direct.check("[::1]", 80, std::time::Duration::from_secs(5)).await, Err(Refused::Private(_))));
        assert!(direct.check("localhost", 80, std::time::Duration::from_secs(5)).await.is_ok(), "left to the resolver");
        let proxied = Guard { allow_private_targets: false, via_proxy: true };
        assert!(matches!(proxied.check("localhost", 80, std::time::Duration::from_secs(5)).await, Err(Refused::Private(PrivateAddress { ref host, .. })) if host == "localhost"));
        let open = Guard { allow_private_targets: true, via_proxy: true };
        assert!(open.check("127.0.0.1", 80, std::time::Duration::from_secs(5)).await.is_ok());
    }

    /// `localhost` resolves (from the hosts file, no network) to loopback: refused, and the
    /// refusal is found again through the boxed error chain a client wraps it in.
    #[tokio::test]
    async fn the_resolver_refuses_a_name_of_a_private_address() {
        let name: Name = "localhost".parse().unwrap();
        let Err(err) = GuardedResolver.resolve(name).await else { panic!("localhost was let through") };
        let refused = refusal(err.as_ref()).expect("a PrivateAddress in the chain");
        assert_eq!(refused.host, "localhost");
        assert!(is_private(&refused.ip));
    }
}
