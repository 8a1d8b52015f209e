//! What the server loop sleeps on: one `poll(2)` over every descriptor it waits for, the
//! ZMQ sockets' included through their `ZMQ_FD`, and the rule that makes sleeping on a
//! ZMQ socket's descriptor safe ([`Watched`]).
//!
//! `zmq_poll` made every loop turn cost a non-blocking `poll` pass before the blocking
//! one, and a `ZMQ_EVENTS` check (itself a `poll` of libzmq's mailbox) per ZMQ socket per
//! pass, whether or not the turn had touched ZMQ; a request over the local stream
//! transport paid three `poll` calls and a mailbox `read` for one `read` and one `write`
//! of its own. Here a turn that did nothing on ZMQ costs one `poll(2)`.
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
//! is not; a socket that may hold a message makes the poll return at once, and the loop
//! receives from it until `EAGAIN` ([`Watched::may_have_message`]).

use std::os::fd::RawFd;

/// A ZMQ socket with what the server knows of its readiness. Every send and receive on
/// it goes through here, so the state cannot go stale behind its back.
pub(crate) struct Watched {
    socket: zmq::Socket,
    fd: RawFd,
    /// Something may have processed commands since the socket was last settled.
    unsettled: bool,
    /// A message may be waiting (the descriptor polled readable, a settle saw `POLLIN`,
    /// or receiving stopped before `EAGAIN`).
    maybe_message: bool,
}

impl Watched {
    /// Watches `socket` (unsettled, a message possibly waiting: the first turn looks).
    pub(crate) fn new(socket: zmq::Socket) -> Result<Self, zmq::Error> {
        let fd = socket.get_fd()?;
        Ok(Watched {
            socket,
            fd,
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

    /// The descriptor to poll for `POLLIN`.
    pub(crate) fn fd(&self) -> RawFd {
        self.fd
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

    /// Takes what `poll` said of the descriptor: readable means commands to process, so
    /// possibly a message.
    pub(crate) fn polled(&mut self, revents: i16) {
        if revents & (libc::POLLIN | libc::POLLERR) != 0 {
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

/// `poll(2)` over `fds`; `EINTR` is returned (the caller's loop recomputes its
/// timeout). `timeout_ms` < 0 waits without limit.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> std::io::Result<usize> {
    let n = libc::nfds_t::try_from(fds.len())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `fds` is a live, exclusively borrowed slice of `n` initialised `pollfd`s;
    // `poll` reads their `fd`/`events` and writes only their `revents` within the slice,
    // and keeps no pointer after it returns. Closed or invalid descriptors are reported
    // in `revents` (`POLLNVAL`), not undefined behaviour.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), n, timeout_ms) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// A `pollfd` asking for `events` on `fd`.
pub(crate) fn pollfd(fd: RawFd, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
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
                let mut fds = [pollfd(self.router.fd(), libc::POLLIN)];
                poll(&mut fds, left.max(1)).expect("poll");
                self.router.polled(fds[0].revents);
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
