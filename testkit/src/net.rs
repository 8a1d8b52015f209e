//! Loopback ports for daemons a test or a bench starts.

use std::sync::Mutex;

use rand::Rng;

/// A free TCP port on loopback for a daemon to bind, chosen outside the kernel's
/// ephemeral range (`net.ipv4.ip_local_port_range`) and never twice in one process.
///
/// A port bound to 0 and released comes from the ephemeral range, where every socket
/// bound to port 0 meanwhile (another daemon's data port, any outgoing connection's
/// local end) may take it before the daemon binds it: the p2p bench lost a daemon that
/// way ("Address already in use"). Outside the range only another process picking the
/// same port between this check and the bind can, and the pick is random.
///
/// Panics when no port outside the range is free (a machine whose range leaves no room
/// below or above it).
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|x| x.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    // below the range when there is room, else above it
    let (from, to) = if range.0 >= 12_000 {
        (10_000, range.0)
    } else {
        (range.1.saturating_add(1), u16::MAX)
    };
    assert!(
        to > from + 100,
        "no ports outside the ephemeral range {range:?}"
    );
    let mut rng = rand::thread_rng();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        let p = rng.gen_range(from..to);
        if !given.contains(&p) && std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            given.push(p);
            return p;
        }
    }
    panic!("no free port in {from}..{to}");
}

#[cfg(test)]
mod tests {
    #[test]
    fn ports_are_free_and_never_given_twice() {
        let a: Vec<u16> = (0..20).map(|_| super::free_port()).collect();
        let mut b = a.clone();
        b.sort_unstable();
        b.dedup();
        assert_eq!(a.len(), b.len());
        for p in a {
            assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
        }
    }
}
