//! Rendezvous: rank 0 hands a small blob (NCCL's 128-byte unique id) to every other rank before
//! a communicator exists. Used by `NcclGroup::from_env` (feature `nccl`); plain `std`, so it is
//! tested on the CPU.
//!
//! ```text
//!  TCP (default when MASTER_ADDR is set)          file (CANDLE_CP_NCCL_ID_FILE, or no MASTER_ADDR)
//!  rank 0: listen on 0.0.0.0:MASTER_PORT          rank 0: write <path>.tmp<pid>, rename to <path>
//!  rank r: connect MASTER_ADDR:MASTER_PORT        rank r: poll <path> until it holds `len` bytes
//!          ──▶ "CCPRDV01" rank world len
//!          ◀── "CCPRDV01" blob   (or "CCPRDERR" message)
//! ```
//!
//! Every wait is bounded by a timeout; errors name the rank, the world size, the address or
//! path and, on the server, the ranks that never came. A rank that claims another world size
//! or blob length gets an error, and so does the server.

use candle_core::{Error, Result};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const HELLO: &[u8; 8] = b"CCPRDV01";
const ERR: &[u8; 8] = b"CCPRDERR";
/// Largest blob a rendezvous carries (NCCL's id is 128 bytes).
pub const MAX_BLOB: usize = 1 << 16;

/// How ranks meet (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// Rank 0 serves the blob on `port` (all interfaces); the others connect to `host:port`.
    Tcp {
        /// Rank 0's host name or address, as the other ranks reach it.
        host: String,
        /// The port rank 0 listens on.
        port: u16,
    },
    /// Rank 0 writes the blob to this path (atomically, by rename); the others poll for it. For
    /// several nodes the path must be on a filesystem they all see. A file left by an earlier
    /// run can be read before rank 0 rewrites it: use a fresh path per run.
    File(PathBuf),
}

impl Rendezvous {
    /// From the launcher environment: `CANDLE_CP_NCCL_ID_FILE` set → [`Rendezvous::File`] at
    /// that path; else `MASTER_ADDR` set → [`Rendezvous::Tcp`] on `MASTER_ADDR:MASTER_PORT`
    /// (port default 29500); else a file `$TMPDIR/candle-cp-nccl-localhost-<MASTER_PORT>.id`
    /// (one node).
    pub fn from_env() -> Result<Self> {
        if let Some(p) = std::env::var_os("CANDLE_CP_NCCL_ID_FILE") {
            return Ok(Rendezvous::File(p.into()));
        }
        let port_s = std::env::var("MASTER_PORT").unwrap_or_else(|_| "29500".into());
        let port: u16 = port_s
            .trim()
            .parse()
            .map_err(|_| Error::Msg(format!("rendezvous: MASTER_PORT={port_s:?} is not a port number")))?;
        match std::env::var("MASTER_ADDR") {
            Ok(host) if !host.trim().is_empty() => Ok(Rendezvous::Tcp { host: host.trim().to_string(), port }),
            _ => Ok(Rendezvous::File(std::env::temp_dir().join(format!("candle-cp-nccl-localhost-{port}.id")))),
        }
    }

    /// Rank 0 passes `Some(blob)` and gets it back once every rank `1..world` has it (TCP) or
    /// once it is written (file); rank `r > 0` passes `None` and gets rank 0's blob of `len`
    /// bytes. Waits at most `timeout`.
    pub fn share(&self, rank: usize, world: usize, blob: Option<&[u8]>, len: usize, timeout: Duration) -> Result<Vec<u8>> {
        if rank >= world || len == 0 || len > MAX_BLOB {
            candle_core::bail!("rendezvous: rank {rank} of world {world} with a {len}-byte blob (1..={MAX_BLOB} bytes, rank < world)")
        }
        if (rank == 0) != blob.is_some() || blob.is_some_and(|b| b.len() != len) {
            candle_core::bail!(
                "rendezvous: rank 0 (and only rank 0) passes the {len}-byte blob; rank {rank} passed {:?} bytes",
                blob.map(|b| b.len())
            )
        }
        match (self, blob) {
            (_, Some(b)) if world == 1 => Ok(b.to_vec()), // nobody to hand it to
            (Rendezvous::Tcp { port, .. }, Some(b)) => {
                let listener = TcpListener::bind(("0.0.0.0", *port))
                    .map_err(|e| Error::Msg(format!("rendezvous: rank 0 of {world} cannot listen on port {port}: {e}")))?;
                serve(&listener, world, b, timeout)?;
                Ok(b.to_vec())
            }
            (Rendezvous::Tcp { host, port }, None) => fetch(host, *port, rank, world, len, timeout),
            (Rendezvous::File(path), Some(b)) => {
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                std::fs::write(&tmp, b)
                    .and_then(|_| std::fs::rename(&tmp, path))
                    .map_err(|e| Error::Msg(format!("rendezvous: rank 0 cannot write {}: {e}", path.display())))?;
                Ok(b.to_vec())
            }
            (Rendezvous::File(path), None) => {
                let start = Instant::now();
                loop {
                    match std::fs::read(path) {
                        Ok(b) if b.len() == len => return Ok(b),
                        _ if start.elapsed() > timeout => candle_core::bail!(
                            "rendezvous: rank {rank} of {world} found no {len}-byte blob at {} after {timeout:?}",
                            path.display()
                        ),
                        _ => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }
        }
    }
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Msg(format!("{what}: {e}"))
}

/// Rank 0's side: answer every rank `1..world` once (a rank may reconnect), within `timeout`.
pub fn serve(listener: &TcpListener, world: usize, blob: &[u8], timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let mut missing: BTreeSet<usize> = (1..world).collect();
    listener.set_nonblocking(true).map_err(io_err("rendezvous: rank 0: listener".into()))?;
    while !missing.is_empty() {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            candle_core::bail!(
                "rendezvous: rank 0 of {world}: ranks {:?} did not connect to port {} within {timeout:?}",
                missing.iter().collect::<Vec<_>>(),
                listener.local_addr().map(|a| a.port()).unwrap_or(0)
            )
        }
        let (mut s, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => candle_core::bail!("rendezvous: rank 0 of {world}: accept: {e}"),
        };
        let step = left.min(Duration::from_secs(10));
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(step));
        let _ = s.set_write_timeout(Some(step));
        let mut hello = [0u8; 20];
        if s.read_exact(&mut hello).is_err() || &hello[..8] != HELLO {
            continue; // not one of ours (a port scanner, a half-open retry): ignore it
        }
        let word = |i: usize| u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]) as usize;
        let (r, w, len) = (word(8), word(12), word(16));
        if w != world || len != blob.len() || r == 0 || r >= world {
            let msg = format!(
                "rendezvous: rank {r} from {peer} says world {w} and a {len}-byte blob; rank 0 has world {world} and {} bytes",
                blob.len()
            );
            let _ = s.write_all(ERR).and_then(|_| s.write_all(&(msg.len() as u32).to_le_bytes())).and_then(|_| s.write_all(msg.as_bytes()));
            candle_core::bail!("{msg}")
        }
        if s.write_all(HELLO).and_then(|_| s.write_all(blob)).and_then(|_| s.flush()).is_ok() {
            missing.remove(&r);
        }
    }
    Ok(())
}

/// Rank `rank`'s side: connect to `host:port` (retrying until rank 0 listens), say who it is,
/// read the `len`-byte blob, within `timeout`.
pub fn fetch(host: &str, port: u16, rank: usize, world: usize, len: usize, timeout: Duration) -> Result<Vec<u8>> {
    let start = Instant::now();
    let who = format!("rendezvous: rank {rank} of {world} via {host}:{port}");
    let mut last = String::from("no attempt");
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            candle_core::bail!("{who}: no blob from rank 0 within {timeout:?} (last: {last})")
        }
        match try_fetch(host, port, rank, world, len, left.min(Duration::from_secs(10))) {
            Ok(Ok(b)) => return Ok(b),
            Ok(Err(refused_by_rank0)) => candle_core::bail!("{who}: {refused_by_rank0}"),
            Err(e) => {
                last = e;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// One attempt: `Err(reason)` to retry, `Ok(Err(message))` when rank 0 refused us.
fn try_fetch(host: &str, port: u16, rank: usize, world: usize, len: usize, wait: Duration) -> std::result::Result<std::result::Result<Vec<u8>, String>, String> {
    // Rank 0 listens on IPv4 (0.0.0.0): try the host's IPv4 addresses first ("localhost" often
    // resolves to ::1 before 127.0.0.1), then the others.
    let mut addrs: Vec<SocketAddr> = (host, port).to_socket_addrs().map_err(|e| format!("resolve: {e}"))?.collect();
    addrs.sort_by_key(|a| !a.is_ipv4());
    let mut errs = Vec::new();
    let mut conn = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, wait.min(Duration::from_secs(2))) {
            Ok(s) => {
                conn = Some((s, *a));
                break;
            }
            Err(e) => errs.push(format!("connect {a}: {e}")),
        }
    }
    let (mut s, addr) = conn.ok_or_else(|| if errs.is_empty() { "resolve: no address".to_string() } else { errs.join("; ") })?;
    let _ = s.set_read_timeout(Some(wait));
    let _ = s.set_write_timeout(Some(wait));
    let mut hello = HELLO.to_vec();
    for v in [rank, world, len] {
        hello.extend_from_slice(&(v as u32).to_le_bytes());
    }
    s.write_all(&hello).map_err(|e| format!("send: {e}"))?;
    let mut tag = [0u8; 8];
    s.read_exact(&mut tag).map_err(|e| format!("read: {e}"))?;
    if &tag == ERR {
        let mut n = [0u8; 4];
        s.read_exact(&mut n).map_err(|e| format!("read: {e}"))?;
        let mut msg = vec![0u8; (u32::from_le_bytes(n) as usize).min(4096)];
        s.read_exact(&mut msg).map_err(|e| format!("read: {e}"))?;
        return Ok(Err(String::from_utf8_lossy(&msg).into_owned()));
    }
    if &tag != HELLO {
        return Err(format!("{addr} is not a candle-cp rendezvous (got {tag:?})"));
    }
    let mut blob = vec![0u8; len];
    s.read_exact(&mut blob).map_err(|e| format!("read blob: {e}"))?;
    Ok(Ok(blob))
}
