//! A TCP proxy between the bridge and a service whose connections can be cut or hung.

use std::net::{SocketAddr, ToSocketAddrs};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    /// New connections are accepted and closed at once.
    Refuse,
    /// Nothing is forwarded: bytes wait in the proxy, connections hang.
    Hold,
}

#[derive(Debug, Clone, Copy)]
struct State {
    mode: Mode,
    /// Connections are numbered by the epoch they were accepted in.
    epoch: u64,
    /// Connections of an epoch below this are closed.
    cut_below: u64,
    /// Connections of an epoch below this never forward again (a half-open TCP
    /// connection: no FIN, no RST, no bytes), but stay open.
    frozen_below: u64,
}

/// A TCP proxy 127.0.0.1:<any> -> `target` whose connections can be cut or hung.
pub struct Proxy {
    pub addr: SocketAddr,
    state: watch::Sender<State>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let (state, rx) = watch::channel(State {
            mode: Mode::Pass,
            epoch: 0,
            cut_below: 0,
            frozen_below: 0,
        });
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let st = *rx.borrow();
                if st.mode == Mode::Refuse {
                    drop(inbound);
                    continue;
                }
                tokio::spawn(serve(inbound, target, rx.clone(), st.epoch));
            }
        });
        Self {
            addr,
            state,
            accept,
        }
    }

    /// Closes every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.state.send_modify(|s| {
            s.epoch += 1;
            s.cut_below = s.epoch;
            s.mode = Mode::Refuse;
        });
    }

    /// Stops forwarding on every connection, old and new, until [`Proxy::restore`].
    pub fn hold(&self) {
        self.state.send_modify(|s| s.mode = Mode::Hold);
    }

    /// The connections open now hang forever (half-open); new ones work.
    pub fn freeze_existing(&self) {
        self.state.send_modify(|s| {
            s.epoch += 1;
            s.frozen_below = s.epoch;
            s.mode = Mode::Pass;
        });
    }

    pub fn restore(&self) {
        self.state.send_modify(|s| s.mode = Mode::Pass);
    }

    pub fn redis_url(&self) -> String {
        format!("redis://{}/0", self.addr)
    }

    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Dropping the sender ends every connection task.
        self.state.send_modify(|s| {
            s.cut_below = u64::MAX;
        });
    }
}

enum Gate {
    Open,
    Closed,
}

/// Waits until this connection may forward bytes; `Closed` if it must end.
async fn gate(rx: &mut watch::Receiver<State>, epoch: u64) -> Gate {
    loop {
        let st = *rx.borrow_and_update();
        if epoch < st.cut_below {
            return Gate::Closed;
        }
        let frozen = epoch < st.frozen_below;
        if !frozen && st.mode == Mode::Pass {
            return Gate::Open;
        }
        if rx.changed().await.is_err() {
            return Gate::Closed;
        }
    }
}

async fn serve(inbound: TcpStream, target: SocketAddr, mut rx: watch::Receiver<State>, epoch: u64) {
    // A held proxy does not even connect upstream: the client's handshake hangs.
    if let Gate::Closed = gate(&mut rx, epoch).await {
        return;
    }
    let Ok(outbound) = TcpStream::connect(target).await else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::join!(
        pump(in_read, out_write, rx.clone(), epoch),
        pump(out_read, in_write, rx, epoch)
    );
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut rx: watch::Receiver<State>,
    epoch: u64,
) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        if let Gate::Closed = gate(&mut rx, epoch).await {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        // Bytes read just before a hold wait in the proxy until it lifts.
        if let Gate::Closed = gate(&mut rx, epoch).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The socket address of a `redis://` or `amqp://` URL, for [`Proxy::start`].
pub fn socket_addr(url: &str) -> SocketAddr {
    let parsed = url::Url::parse(url).expect("service url");
    let host = parsed.host_str().expect("host");
    let port = parsed
        .port_or_known_default()
        .unwrap_or(match parsed.scheme() {
            "redis" => 6379,
            _ => 5672,
        });
    (host, port)
        .to_socket_addrs()
        .expect("resolve")
        .next()
        .expect("an address")
}
