//! The address guard under the HTTP client of per-job URLs: a DNS resolver that drops
//! every address a job's URL may not reach ([`crate::job::url::forbidden_address`]) and
//! fails when none is left. It runs when the connection is made, on the addresses that
//! connection will use, so a name that resolves to a public address when ingested and
//! to a private one later (DNS rebinding) cannot slip past. Literal addresses never
//! reach a resolver: `targets::check_job_url` judges them before the request.

use std::net::SocketAddr;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

use crate::job::url::forbidden_address;

/// Resolves with the system's resolver, then keeps only global addresses.
#[derive(Debug, Default)]
pub(super) struct GlobalOnly;

/// The error a connection refused by the guard carries (found again in the request's
/// error chain, so the job is parked rather than retried).
#[derive(Debug)]
pub(super) struct AddressRefused(pub(super) String);

impl std::fmt::Display for AddressRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AddressRefused {}

impl Resolve for GlobalOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = found
                .into_iter()
                .partition(|addr| forbidden_address(addr.ip()).is_none());
            if allowed.is_empty() {
                let reason = match refused.first() {
                    Some(addr) => format!(
                        "{host} resolves to {}, {}; a job's own URL may not reach it (the target's allow_private_job_urls)",
                        addr.ip(),
                        forbidden_address(addr.ip()).unwrap_or("a forbidden address")
                    ),
                    None => format!("{host} resolves to no address"),
                };
                return Err(Box::new(AddressRefused(reason)) as _);
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

/// The guard's refusal in `err`'s chain, if that is why the request failed.
pub(super) fn refusal<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a AddressRefused> {
    let mut source = Some(err);
    while let Some(e) = source {
        if let Some(refused) = e.downcast_ref::<AddressRefused>() {
            return Some(refused);
        }
        source = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn localhost_is_refused_and_says_why() {
        let name: Name = "localhost".parse().expect("a name");
        let err = match GlobalOnly.resolve(name).await {
            Ok(addrs) => panic!("resolved to {:?}", addrs.collect::<Vec<_>>()),
            Err(err) => err,
        };
        let refused = refusal(err.as_ref()).expect("the guard's refusal");
        assert!(refused.0.contains("a loopback address"), "{}", refused.0);
    }
}
