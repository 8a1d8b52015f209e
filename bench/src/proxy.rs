//! A TCP proxy that damages what it forwards, on request: the wire between two daemons'
//! data planes in `kvd-bench integrity` (a daemon advertises the proxy's address as its
//! data plane, `transfer.advertise_data`, so its peers connect through it).
//!
//! Faults, each armed once and spent by the traffic that meets it:
//! - **flip**: a burst of damage `n` bytes further along the forwarded stream (either
//!   direction, any connection): one bit of that byte, and every bit of the
//!   [`BURST`] - 1 bytes after it in the same read, as a bad link damages a run of
//!   bytes; block bytes, CRC tables or request heads get it;
//! - **stall**: the next chunk to pass waits `d` before it goes on (every connection
//!   behind it waits too: a peer that stops answering);
//! - **cut**: every open connection is shut down in both directions at once.
//!
//! Bounded by construction: one thread per direction per connection, stopped with the
//! proxy (its listener is woken by a connection of its own).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bytes a flip damages.
pub const BURST: usize = 8;

#[derive(Default)]
struct Armed {
    /// Bytes still to pass before the one whose bit flips.
    flip_in: Option<u64>,
    /// The next chunk's wait.
    stall: Option<Duration>,
}

struct Shared {
    target: SocketAddr,
    armed: Mutex<Armed>,
    /// Open connections (both ends), for a cut.
    conns: Mutex<Vec<TcpStream>>,
    stop: AtomicBool,
    /// Faults spent: bits flipped, stalls served, cuts made.
    flips: AtomicU64,
    stalls: AtomicU64,
    cuts: AtomicU64,
    bytes: AtomicU64,
}

/// A running proxy; stopped when dropped.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<std::thread::JoinHandle<()>>,
}

/// What a proxy's faults did so far.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Spent {
    pub flips: u64,
    pub stalls: u64,
    pub cuts: u64,
    pub bytes: u64,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub fn start(target: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            target,
            armed: Mutex::new(Armed::default()),
            conns: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            flips: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            cuts: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("proxy-accept".into())
            .spawn(move || {
                for c in listener.incoming() {
                    if sh.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(client) = c else { continue };
                    let Ok(server) = TcpStream::connect_timeout(&sh.target, Duration::from_secs(2))
                    else {
                        continue; // the daemon behind is down: the client sees a close
                    };
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let clones = (client.try_clone(), server.try_clone());
                    let (Ok(c2), Ok(s2)) = clones else { continue };
                    if let (Ok(a), Ok(b)) = (client.try_clone(), server.try_clone()) {
                        let mut conns = sh.conns.lock().unwrap_or_else(|p| p.into_inner());
                        conns.retain(|s| s.peer_addr().is_ok());
                        conns.extend([a, b]);
                    }
                    for (from, to) in [(client, s2), (server, c2)] {
                        let sh = sh.clone();
                        let _ = std::thread::Builder::new()
                            .name("proxy-pump".into())
                            .spawn(move || pump(&sh, from, to));
                    }
                }
            })?;
        Ok(Proxy {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// Where peers connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Damages the bytes from `n` bytes along the forwarded stream from now (a burst).
    pub fn flip_in(&self, n: u64) {
        self.armed().flip_in = Some(n);
    }

    /// The next chunk forwarded waits `d` first.
    pub fn stall(&self, d: Duration) {
        self.armed().stall = Some(d);
    }

    /// Shuts every open connection down now.
    pub fn cut(&self) {
        let conns =
            std::mem::take(&mut *self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()));
        for s in &conns {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.shared.cuts.fetch_add(1, Ordering::Relaxed);
    }

    /// What the faults did so far.
    pub fn spent(&self) -> Spent {
        let s = &self.shared;
        Spent {
            flips: s.flips.load(Ordering::Relaxed),
            stalls: s.stalls.load(Ordering::Relaxed),
            cuts: s.cuts.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
        }
    }

    fn armed(&self) -> std::sync::MutexGuard<'_, Armed> {
        self.shared.armed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.cut();
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Forwards `from` to `to` until either side closes, spending armed faults on the way.
fn pump(sh: &Shared, mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        let stall = {
            let mut a = sh.armed.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(left) = a.flip_in {
                if left < n as u64 {
                    let at = left as usize;
                    if let Some(b) = chunk.get_mut(at) {
                        *b ^= 1 << (left % 8);
                    }
                    for b in chunk.iter_mut().skip(at + 1).take(BURST - 1) {
                        *b ^= 0xff;
                    }
                    a.flip_in = None;
                    sh.flips.fetch_add(1, Ordering::Relaxed);
                } else {
                    a.flip_in = Some(left - n as u64);
                }
            }
            a.stall.take()
        };
        if let Some(d) = stall {
            sh.stalls.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(d);
        }
        sh.bytes.fetch_add(n as u64, Ordering::Relaxed);
        if to.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind the proxy: bytes pass unchanged until a flip is armed, then
    /// exactly the burst from the armed byte differs (one bit of it); a cut closes the
    /// connection.
    #[test]
    fn forwards_flips_one_bit_and_cuts() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in echo.incoming() {
                let Ok(mut c) = c else { break };
                std::thread::spawn(move || {
                    let mut b = [0u8; 4096];
                    while let Ok(n) = c.read(&mut b) {
                        if n == 0 || c.write_all(&b[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let p = Proxy::start(target).unwrap();
        let mut c = TcpStream::connect(p.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let msg: Vec<u8> = (0..100u8).collect();
        let mut got = vec![0u8; 100];
        c.write_all(&msg).unwrap();
        c.read_exact(&mut got).unwrap();
        assert_eq!(got, msg);
        p.flip_in(10);
        c.write_all(&msg).unwrap();
        c.read_exact(&mut got).unwrap();
        let diff: Vec<usize> = (0..100).filter(|&i| got[i] != msg[i]).collect();
        assert_eq!(diff, (10..10 + BURST).collect::<Vec<_>>());
        assert_eq!((got[10] ^ msg[10]).count_ones(), 1);
        assert!((11..10 + BURST).all(|i| got[i] == !msg[i]));
        assert_eq!(p.spent().flips, 1);
        p.cut();
        let mut one = [0u8; 1];
        assert!(matches!(c.read(&mut one), Ok(0) | Err(_)), "cut: closed");
    }
}
