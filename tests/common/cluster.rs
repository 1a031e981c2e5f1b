//! A private Redis Cluster on loopback for one test: `masters` primaries with one
//! replica each, started from scratch in a temp dir and killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub struct Cluster {
    pub ports: Vec<u16>,
    nodes: Vec<Option<Child>>,
    dir: PathBuf,
}

fn free_port_pair() -> u16 {
    // The cluster bus listens on port + 10000; both must be free.
    for _ in 0..200 {
        let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(addr) = listener.local_addr() else {
            continue;
        };
        let port = addr.port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

impl Cluster {
    pub fn start(masters: usize) -> Self {
        let dir = std::env::temp_dir().join(super::unique("cluster"));
        std::fs::create_dir_all(&dir).expect("cluster temp dir");
        let mut ports = Vec::new();
        let mut nodes = Vec::new();
        for _ in 0..masters * 2 {
            let port = free_port_pair();
            let node_dir = dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).expect("node dir");
            let child = redisched_testkit::redis_server(port, &node_dir)
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-config-file", "nodes.conf", "--appendonly", "no"])
                .spawn()
                .expect("redis-server must be installed (apt-get install redis-server)");
            ports.push(port);
            nodes.push(Some(child));
        }
        let cluster = Self { ports, nodes, dir };
        for port in &cluster.ports {
            cluster.wait_for(*port, "PING", "PONG");
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            created.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        for port in &cluster.ports {
            cluster.wait_for(*port, "CLUSTER INFO", "cluster_state:ok");
        }
        cluster
    }

    fn wait_for(&self, port: u16, command: &str, expect: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new("redis-cli")
                .args(["-p", &port.to_string()])
                .args(command.split(' '))
                .output();
            if let Ok(out) = out {
                if String::from_utf8_lossy(&out.stdout).contains(expect) {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "node {port}: no {expect:?} after 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis-cluster://` URL listing every node as a seed.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis-cluster://{}", hosts.join(","))
    }

    /// Ports of the current primaries.
    pub fn masters(&self) -> Vec<u16> {
        self.ports
            .iter()
            .copied()
            .filter(|p| {
                self.nodes[self.index(*p)].is_some()
                    && Command::new("redis-cli")
                        .args(["-p", &p.to_string(), "ROLE"])
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).starts_with("master"))
                        .unwrap_or(false)
            })
            .collect()
    }

    fn index(&self, port: u16) -> usize {
        self.ports
            .iter()
            .position(|p| *p == port)
            .expect("a node of this cluster")
    }

    /// `CLUSTER NODES` as one node sees it.
    fn nodes_table(&self) -> String {
        let port = self.masters()[0];
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .and_then(|c| c.get_connection())
            .expect("connect to a cluster node");
        redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut conn)
            .expect("CLUSTER NODES")
    }

    /// The port of the primary that owns `key`'s slot.
    pub fn primary_of(&self, key: &str) -> u16 {
        let port = self.masters()[0];
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .and_then(|c| c.get_connection())
            .expect("connect to a cluster node");
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut conn)
            .expect("CLUSTER KEYSLOT");
        for line in self.nodes_table().lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") {
                continue;
            }
            let owns = fields[8..].iter().any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                matches!((low.parse::<u16>(), high.parse::<u16>()), (Ok(l), Ok(h)) if (l..=h).contains(&slot))
            });
            if owns {
                return node_port(fields[1]);
            }
        }
        panic!("no primary owns slot {slot} of {key:?}");
    }

    /// The port of a replica of the primary on `primary`.
    pub fn replica_of(&self, primary: u16) -> u16 {
        let table = self.nodes_table();
        let lines: Vec<Vec<&str>> = table
            .lines()
            .map(|line| line.split_whitespace().collect())
            .collect();
        let id = lines
            .iter()
            .find(|fields| fields.len() > 3 && node_port(fields[1]) == primary)
            .map(|fields| fields[0])
            .expect("the primary is in CLUSTER NODES");
        lines
            .iter()
            .find(|fields| fields.len() > 3 && fields[2].contains("slave") && fields[3] == id)
            .map(|fields| node_port(fields[1]))
            .expect("the primary has a replica")
    }

    /// SIGSTOP: the node stops reading and answering (a stalled replica) until
    /// [`Cluster::resume`].
    pub fn pause(&self, port: u16) {
        self.signal(port, "-STOP");
    }

    pub fn resume(&self, port: u16) {
        self.signal(port, "-CONT");
    }

    fn signal(&self, port: u16, signal: &str) {
        let pid = self.nodes[self.index(port)]
            .as_ref()
            .expect("a running node")
            .id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// SIGKILLs one node.
    pub fn kill(&mut self, port: u16) {
        let index = self.index(port);
        if let Some(mut child) = self.nodes[index].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until every live node reports a healthy cluster again.
    pub fn wait_healthy(&self) {
        for port in &self.ports {
            if self.nodes[self.index(*port)].is_some() {
                self.wait_for(*port, "CLUSTER INFO", "cluster_state:ok");
            }
        }
    }
}

/// The client port of a `CLUSTER NODES` address (`127.0.0.1:7000@17000`).
fn node_port(address: &str) -> u16 {
    address
        .split('@')
        .next()
        .and_then(|hostport| hostport.rsplit(':').next())
        .and_then(|port| port.parse().ok())
        .expect("a node address")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.nodes.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
