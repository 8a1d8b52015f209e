//! What the server loop sleeps on: one `epoll_wait` over every descriptor it waits for
//! ([`Interest`]), the ZMQ sockets' included through their `ZMQ_FD`, and the rule that
//! makes sleeping on a ZMQ socket's descriptor safe ([`Watched`]).
//!
//! `zmq_poll` made every loop turn cost a non-blocking `poll` pass before the blocking
//! one, and a `ZMQ_EVENTS` check (itself a `poll` of libzmq's mailbox) per ZMQ socket per
//! pass, whether or not the turn had touched ZMQ; a request over the local stream
//! transport paid three `poll` calls and a mailbox `read` for one `read` and one `write`
//! of its own. Here a turn that did nothing on ZMQ costs one `epoll_wait`.
//!
//! The rule. A ZMQ socket's `ZMQ_FD` is libzmq's command mailbox, not a readiness signal:
//! it becomes readable when the socket has commands to process (a peer's pipe became
//! readable, a connection came or went), and any operation on the socket may process
//! them — after which a message can be waiting while the descriptor reads idle. So a
//! [`Watched`] socket is *settled* only after a call that processed every pending command
//! and found no message (a receive that returned `EAGAIN`, or a `ZMQ_EVENTS` check
//! without `POLLIN`), with nothing done on it since; from then on its descriptor turns
//! readable with the next command, because only this thread's calls on the socket consume
//! the signal. Before the loop sleeps, [`Watched::must_not_sleep`] settles a socket that
//! is not; a socket that may hold a message makes the wait return at once, and the loop
//! receives from it until `EAGAIN` ([`Watched::may_have_message`]).

use std::os::fd::RawFd;

/// A ZMQ socket with what the server knows of its readiness. Every send and receive on
/// it goes through here, so the state cannot go stale behind its back.
pub(crate) struct Watched {
    socket: zmq::Socket,
    fd: RawFd,
    /// Unique to this socket in the process: its [`Interest`] key stays apart from a
    /// later socket's that reuses the descriptor number.
    serial: u64,
    /// Something may have processed commands since the socket was last settled.
    unsettled: bool,
    /// A message may be waiting (the descriptor polled readable, a settle saw `POLLIN`,
    /// or receiving stopped before `EAGAIN`).
    maybe_message: bool,
}

impl Watched {
    /// Watches `socket` (unsettled, a message possibly waiting: the first turn looks).
    pub(crate) fn new(socket: zmq::Socket) -> Result<Self, zmq::Error> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let fd = socket.get_fd()?;
        Ok(Watched {
            socket,
            fd,
            serial: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            unsettled: true,
            maybe_message: true,
        })
    }

    /// The socket, for setup that moves no message (binding, options, endpoints); what
    /// it does is looked at before the next sleep.
    pub(crate) fn setup(&mut self) -> &zmq::Socket {
        self.unsettled = true;
        &self.socket
    }

    /// The descriptor to wait on for `IN`.
    pub(crate) fn fd(&self) -> RawFd {
        self.fd
    }

    /// A number no other `Watched` of this process has (for [`Interest`] keys).
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }

    /// Sends one frame (never waits: callers pass `DONTWAIT`).
    pub(crate) fn send<T: zmq::Sendable>(&mut self, data: T, flags: i32) -> zmq::Result<()> {
        self.unsettled = true;
        self.socket.send(data, flags)
    }

    /// Receives one frame without waiting. `EAGAIN` settles the socket.
    pub(crate) fn recv(&mut self, msg: &mut zmq::Message) -> zmq::Result<()> {
        let r = self.socket.recv(msg, zmq::DONTWAIT);
        self.after_recv(r.as_ref().err());
        r
    }

    /// Receives one whole message without waiting. `EAGAIN` settles the socket.
    pub(crate) fn recv_multipart(&mut self) -> zmq::Result<Vec<Vec<u8>>> {
        let r = self.socket.recv_multipart(zmq::DONTWAIT);
        self.after_recv(r.as_ref().err());
        r
    }

    fn after_recv(&mut self, e: Option<&zmq::Error>) {
        match e {
            None => {
                // More may follow; the receive may have processed commands.
                self.unsettled = true;
                self.maybe_message = true;
            }
            Some(zmq::Error::EAGAIN) => {
                // libzmq processed every command before it gave up: settled, empty.
                self.unsettled = false;
                self.maybe_message = false;
            }
            Some(_) => {
                // Interrupted, or worse: the next settle asks `ZMQ_EVENTS`.
                self.unsettled = true;
                self.maybe_message = false;
            }
        }
    }

    /// Whether a receive may find a message this turn.
    pub(crate) fn may_have_message(&self) -> bool {
        self.maybe_message
    }

    /// Takes what the wait said of the descriptor: readable means commands to process, so
    /// possibly a message.
    pub(crate) fn polled(&mut self, revents: u32) {
        if revents & (IN | ERR_HUP) != 0 {
            self.unsettled = true;
            self.maybe_message = true;
        }
    }

    /// Settles the socket if it is not; returns whether a message may be waiting (then
    /// the loop must not sleep). A failing `ZMQ_EVENTS` counts as a message: the receive
    /// reports the error.
    pub(crate) fn must_not_sleep(&mut self) -> bool {
        if self.maybe_message {
            return true;
        }
        if self.unsettled {
            match self.socket.get_events() {
                Ok(ev) => {
                    self.unsettled = false;
                    self.maybe_message = ev.contains(zmq::POLLIN);
                }
                Err(_) => self.maybe_message = true,
            }
        }
        self.maybe_message
    }
}

/// Level-triggered `epoll` over the descriptors the loop waits for, re-declared every
/// turn with [`Interest::want`]: what is unchanged since the last turn costs no syscall,
/// so a quiet turn is one `epoll_wait`. (`poll(2)` over seven descriptors cost about 3 µs
/// a turn here: it registers and unregisters a wait on every one of them each time.)
///
/// Each descriptor comes with a key the caller chooses, unique to what it stands for
/// (a connection id, a socket's serial): a descriptor number reused by a new file with
/// a new key is re-added, and events of a file that is gone carry its old key, which
/// the caller no longer knows and skips. A descriptor not wanted in a turn is removed
/// before the wait.
pub(crate) struct Interest {
    epoll: std::os::fd::OwnedFd,
    /// fd → (key, events, the turn it was last wanted in).
    registered: std::collections::HashMap<RawFd, (u64, u32, u64)>,
    turn: u64,
    /// How many of `registered` this turn has wanted so far.
    wanted: usize,
    buf: Vec<libc::epoll_event>,
    ready: Vec<(u64, u32)>,
}

/// Readable (`EPOLLIN` = `POLLIN`).
pub(crate) const IN: u32 = libc::EPOLLIN as u32;
/// Writable.
pub(crate) const OUT: u32 = libc::EPOLLOUT as u32;
/// An error or hang-up (always reported).
pub(crate) const ERR_HUP: u32 = (libc::EPOLLERR | libc::EPOLLHUP) as u32;

/// Events one wait reports at most; level-triggered, the rest come the next turn.
const MAX_EVENTS: usize = 64;

impl Interest {
    pub(crate) fn new() -> std::io::Result<Interest> {
        // SAFETY: `epoll_create1` takes no pointers; a non-negative result is a new
        // descriptor that nothing else owns, so `OwnedFd` may take it.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above: `fd` is open and owned by nobody else.
        let epoll = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Interest {
            epoll,
            registered: std::collections::HashMap::new(),
            turn: 0,
            wanted: 0,
            buf: Vec::with_capacity(MAX_EVENTS),
            ready: Vec::with_capacity(MAX_EVENTS),
        })
    }

    fn ctl(&self, op: i32, fd: RawFd, key: u64, events: u32) -> std::io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: key };
        // SAFETY: `ev` is a live, initialised `epoll_event` the kernel only reads during
        // the call (and ignores for `EPOLL_CTL_DEL`); the epoll descriptor is ours and
        // open. A bad `fd` is reported as an error, not undefined behaviour.
        let r = unsafe {
            libc::epoll_ctl(
                std::os::fd::AsRawFd::as_raw_fd(&self.epoll),
                op,
                fd,
                &mut ev,
            )
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Wants `events` on `fd` under `key` this turn. A negative `fd` (a tier without a
    /// descriptor) is skipped.
    pub(crate) fn want(&mut self, fd: RawFd, key: u64, events: u32) -> std::io::Result<()> {
        if fd < 0 {
            return Ok(());
        }
        let turn = self.turn;
        match self.registered.get_mut(&fd) {
            Some(r) if r.0 == key && r.1 == events => {
                // The steady state: no syscall, no insert.
                if r.2 != turn {
                    r.2 = turn;
                    self.wanted += 1;
                }
                return Ok(());
            }
            Some(_) => match self.ctl(libc::EPOLL_CTL_MOD, fd, key, events) {
                // The old file closed (which unregistered it); this is a new one.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    self.ctl(libc::EPOLL_CTL_ADD, fd, key, events)?
                }
                r => r?,
            },
            None => match self.ctl(libc::EPOLL_CTL_ADD, fd, key, events) {
                // Registered under this number by a file we lost track of: take it over.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    self.ctl(libc::EPOLL_CTL_MOD, fd, key, events)?
                }
                r => r?,
            },
        }
        if self.registered.insert(fd, (key, events, turn)).map(|r| r.2) != Some(turn) {
            self.wanted += 1;
        }
        Ok(())
    }

    /// Drops what this turn did not want, waits up to `timeout_ms` (< 0: no limit) and
    /// returns the ready (key, events). `EINTR` is returned as an error.
    pub(crate) fn wait(&mut self, timeout_ms: i32) -> std::io::Result<&[(u64, u32)]> {
        let turn = self.turn;
        self.turn += 1;
        let all_wanted = self.wanted == self.registered.len();
        self.wanted = 0;
        let stale: Vec<RawFd> = if all_wanted {
            Vec::new() // the common turn: no scan, no allocation
        } else {
            self.registered
                .iter()
                .filter(|(_, r)| r.2 != turn)
                .map(|(fd, _)| *fd)
                .collect()
        };
        for fd in stale {
            self.registered.remove(&fd);
            // A closed descriptor is already gone from the set (`EBADF`/`ENOENT`).
            let _ = self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0);
        }
        self.buf.clear();
        // SAFETY: `buf` has capacity for `MAX_EVENTS` entries; the kernel writes at most
        // that many `epoll_event`s into its spare capacity and returns how many, and
        // keeps no pointer after the call. `set_len` below covers only those written.
        let n = unsafe {
            libc::epoll_wait(
                std::os::fd::AsRawFd::as_raw_fd(&self.epoll),
                self.buf.as_mut_ptr(),
                MAX_EVENTS as i32,
                timeout_ms,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel initialised the first `n` (≤ MAX_EVENTS ≤ capacity) entries.
        unsafe { self.buf.set_len(n as usize) };
        self.ready.clear();
        self.ready
            .extend(self.buf.iter().map(|e| ({ e.u64 }, { e.events })));
        Ok(&self.ready)
    }
}

/// The server loop's [`Interest`] keys: a kind in the top byte, an id below it.
pub(crate) mod key {
    pub(crate) const SOCKET: u64 = 1;
    pub(crate) const SIGNALS: u64 = 2;
    pub(crate) const STORE_IO: u64 = 3;
    pub(crate) const GPU: u64 = 4;
    pub(crate) const PEER: u64 = 5;
    pub(crate) const PLANE_WAKE: u64 = 6;
    pub(crate) const FILLED_WAKE: u64 = 7;
    pub(crate) const LISTENER: u64 = 8;
    pub(crate) const UPGRADE: u64 = 9;
    pub(crate) const SUCCESSOR: u64 = 10;
    const LINK: u64 = 1 << 56;
    const CONN: u64 = 2 << 56;
    const ID: u64 = (1 << 56) - 1;

    /// A peer link's socket, by its [`super::Watched::serial`].
    pub(crate) fn link(serial: u64) -> u64 {
        LINK | (serial & ID)
    }

    /// A stream connection, by its id.
    pub(crate) fn conn(id: u64) -> u64 {
        CONN | (id & ID)
    }

    /// The connection id in a [`conn`] key.
    pub(crate) fn conn_id(key: u64) -> Option<u64> {
        (key & !ID == CONN).then_some(key & ID)
    }
}

/// The events `ready` reports for `key` (0 when none).
pub(crate) fn events_of(ready: &[(u64, u32)], key: u64) -> u32 {
    ready.iter().find(|r| r.0 == key).map_or(0, |r| r.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::{Duration, Instant};

    /// What one step of the model does.
    #[derive(Debug, Clone)]
    enum Step {
        /// The peer sends this many messages.
        PeerSends(u8),
        /// The watched side receives at most this many, without draining.
        Take(u8),
        /// The watched side answers the last sender (a send, which may process commands).
        Reply,
        /// The peer receives whatever answers arrived.
        PeerDrains,
        /// Time passes, so what was sent reaches the watched side's pipe.
        Wait,
        /// The loop sleeps and drains until everything sent has arrived.
        Drain,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u8..6).prop_map(Step::PeerSends),
            (0u8..4).prop_map(Step::Take),
            Just(Step::Reply),
            Just(Step::PeerDrains),
            Just(Step::Wait),
            Just(Step::Drain),
        ]
    }

    struct Pair {
        _ctx: zmq::Context,
        router: Watched,
        interest: Interest,
        dealer: zmq::Socket,
        /// Messages sent by the peer and not yet received by the watched side.
        in_flight: usize,
        last_identity: Option<Vec<u8>>,
    }

    impl Pair {
        fn new() -> Pair {
            let ctx = zmq::Context::new();
            let router = ctx.socket(zmq::ROUTER).expect("router");
            router.bind("tcp://127.0.0.1:0").expect("bind");
            let endpoint = router
                .get_last_endpoint()
                .expect("endpoint")
                .expect("utf-8 endpoint");
            let dealer = ctx.socket(zmq::DEALER).expect("dealer");
            dealer.connect(&endpoint).expect("connect");
            Pair {
                router: Watched::new(router).expect("watched"),
                interest: Interest::new().expect("epoll"),
                dealer,
                _ctx: ctx,
                in_flight: 0,
                last_identity: None,
            }
        }

        /// Receives one whole message if one is there; `Ok(false)` on `EAGAIN`.
        fn take_one(&mut self) -> bool {
            match self.router.recv_multipart() {
                Ok(frames) => {
                    assert_eq!(frames.len(), 2, "identity + body");
                    self.last_identity = frames.into_iter().next();
                    self.in_flight -= 1;
                    true
                }
                Err(zmq::Error::EAGAIN) => false,
                Err(e) => panic!("recv: {e}"),
            }
        }

        /// The server loop's sleep-and-drain, until every message sent has arrived or
        /// the deadline passes (a lost wake-up sleeps through to it).
        fn drain_like_the_loop(&mut self) {
            let deadline = Instant::now() + Duration::from_secs(2);
            while self.in_flight > 0 {
                let now = Instant::now();
                assert!(
                    now < deadline,
                    "{} message(s) never woke the loop",
                    self.in_flight
                );
                if self.router.must_not_sleep() {
                    while self.take_one() {}
                    continue;
                }
                let left = deadline.saturating_duration_since(now).as_millis() as i32;
                self.interest
                    .want(self.router.fd(), 7, IN)
                    .expect("epoll_ctl");
                let ready = self.interest.wait(left.max(1)).expect("epoll_wait");
                self.router.polled(events_of(ready, 7));
            }
            // And once everything is in, the loop may sleep: nothing claims a message.
            assert!(!self.router.must_not_sleep() || !self.take_one());
        }

        fn run(&mut self, step: &Step) {
            match *step {
                Step::PeerSends(n) => {
                    for _ in 0..n {
                        self.dealer.send("x", 0).expect("peer send");
                        self.in_flight += 1;
                    }
                }
                Step::Take(n) => {
                    for _ in 0..n {
                        if !self.take_one() {
                            break;
                        }
                    }
                }
                Step::Reply => {
                    if let Some(id) = self.last_identity.clone() {
                        self.router.send(id, zmq::SNDMORE).expect("reply id");
                        self.router.send("y", zmq::DONTWAIT).expect("reply");
                    }
                }
                Step::PeerDrains => while self.dealer.recv_bytes(zmq::DONTWAIT).is_ok() {},
                Step::Wait => std::thread::sleep(Duration::from_millis(3)),
                Step::Drain => self.drain_like_the_loop(),
            }
        }
    }

    /// Keys follow the descriptor's owner, not its number; what a turn does not want is
    /// not waited on; a change of events takes effect.
    #[test]
    fn interest_tracks_what_each_turn_wants() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::os::unix::net::UnixStream;
        let mut int = Interest::new().expect("epoll");
        let (a, mut a_peer) = UnixStream::pair().expect("socketpair");
        int.want(a.as_raw_fd(), 10, IN).expect("want");
        assert!(int.wait(0).expect("wait").is_empty(), "nothing written yet");
        a_peer.write_all(b"x").expect("write");
        int.want(a.as_raw_fd(), 10, IN).expect("want");
        assert_eq!(events_of(int.wait(1000).expect("wait"), 10) & IN, IN);
        // Not wanted this turn: readable, yet not reported.
        assert!(int.wait(0).expect("wait").is_empty());
        // Wanted again, and for writing too.
        int.want(a.as_raw_fd(), 10, IN | OUT).expect("want");
        assert_eq!(events_of(int.wait(0).expect("wait"), 10), IN | OUT);
        // The file closes and a new one takes the same number under a new key: `dup2`
        // puts a new socket at `a`'s number, closing `a`'s file in the same step (no
        // other thread's descriptor can take the number in between, as it could if we
        // closed it and waited for reuse). `a` now owns the number, naming the new file.
        let old = a.as_raw_fd();
        drop(a_peer);
        let (fresh, mut b_peer) = UnixStream::pair().expect("socketpair");
        assert_eq!(
            nix::unistd::dup2(fresh.as_raw_fd(), old).expect("dup2"),
            old
        );
        drop(fresh); // its file lives on at `old`
        let b = a;
        int.want(b.as_raw_fd(), 11, IN)
            .expect("want a reused number");
        assert!(int.wait(0).expect("wait").is_empty());
        b_peer.write_all(b"y").expect("write");
        int.want(b.as_raw_fd(), 11, IN).expect("want");
        let ready = int.wait(1000).expect("wait");
        assert_eq!(events_of(ready, 11) & IN, IN);
        assert_eq!(events_of(ready, 10), 0, "the old key is gone with its file");
        // A descriptor-less tier is skipped, not an error.
        int.want(-1, 12, IN).expect("negative fd skipped");
    }

    #[test]
    fn keys_keep_kinds_apart() {
        assert_eq!(key::conn_id(key::conn(42)), Some(42));
        assert_eq!(key::conn_id(key::link(42)), None);
        assert_eq!(key::conn_id(key::SOCKET), None);
        assert_ne!(key::link(0), key::conn(0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// However sends, partial receives, replies and sleeps interleave, a message the
        /// peer sent always wakes the loop: the edge-triggered descriptor never loses one.
        /// (Each lost wake-up costs the case its 2 s deadline, so the cases are few.)
        #[test]
        fn no_message_sleeps_through_a_poll(steps in proptest::collection::vec(step(), 1..24)) {
            let mut pair = Pair::new();
            for s in &steps {
                pair.run(s);
            }
            pair.drain_like_the_loop();
        }
    }
}
