//! bucketd patch: a TCP stream whose ACKs never wait for the kernel's delayed-ACK timer, for
//! [`NetworkOptions::set_tcp_quickack`], and which, while its switch says so
//! ([`NetworkOptions::set_tcp_ack_coalescing`]), sends them at most once per [`ACK_COALESCE`]
//! while reads come faster.
//!
//! Why quick: a client that acknowledges MQTT messages in batches (after a commit) sends nothing
//! for a while after a burst, so its kernel's delayed ACK (40 ms and more) is the only thing that
//! acknowledges the burst's last TCP segment; a broker with Nagle's algorithm on (Mosquitto's
//! default) holds its next small packets until that ACK arrives.
//!
//! Why at most one per [`ACK_COALESCE`]: an ACK per read is a TCP segment per read, and on a
//! broker with Nagle's algorithm on it is also what makes the broker send each message as a
//! segment of its own, so a fast reader reads two messages at a time: a read, a wake-up and an
//! ACK for every two messages, on both sides. While the ACK waits, the broker's Nagle gathers the
//! messages it writes into one segment.
//!
//! Why a switch: against a broker that enforces a small in-flight window, the client commits
//! once the window's messages are all in, and the broker writes a refill as several segments
//! (it sends each message as it writes it while our ACKs keep up): each waiting ACK would hold
//! the rest of the window a millisecond or two, in a cycle of well under one (PATCHED.md has the
//! figures). bucketd turns coalescing on only while no broker window is known (stated or
//! learned) and its batches are due at hundreds of messages.
//!
//! The rule while coalescing (Linux; elsewhere the stream is the plain socket):
//! - The first read after one of our writes is answered by an ACK at once: it is the broker's
//!   answer to our acknowledgements (a refill of its window), and the rest of that refill waits
//!   for this ACK.
//! - Any other read is answered at once if no ACK went out for [`ACK_COALESCE`]; otherwise its ACK
//!   is owed, and goes out when that time is up (a timer wakes the reading task), unless one of
//!   our writes carries it first.
//! - Between those ACKs the socket is kept in Linux's delayed-ACK mode (`TCP_QUICKACK` 0), so
//!   that its reads do not acknowledge on their own; the kernel's own delayed-ACK timer remains
//!   the bound if the task is not polled.
//!
//! Not coalescing, every read is acknowledged at once and the socket is left in quick-ACK mode
//! (Linux leaves it on its own when we write; the next read re-arms it).
//!
//! [`NetworkOptions::set_tcp_quickack`]: crate::NetworkOptions::set_tcp_quickack
//! [`NetworkOptions::set_tcp_ack_coalescing`]: crate::NetworkOptions::set_tcp_ack_coalescing

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

/// How long the ACK of what was read may wait for the next ACK: a broker with Nagle's algorithm
/// on sends what it wrote meanwhile in one segment. Far below the window learner's shortest quiet
/// (20 ms), and a millisecond of latency where bucketd commits once a second.
pub(crate) const ACK_COALESCE: Duration = Duration::from_millis(1);

/// What a connection's stream does with its ACKs (from [`crate::NetworkOptions`]).
#[derive(Clone, Default)]
pub(crate) struct AckPolicy {
    /// Quick ACKs (`set_tcp_quickack`).
    quick: bool,
    /// While it reads true, ACKs may wait up to [`ACK_COALESCE`] (`set_tcp_ack_coalescing`).
    coalescing: Option<Arc<AtomicBool>>,
}

impl AckPolicy {
    pub(crate) fn of(options: &crate::NetworkOptions) -> AckPolicy {
        AckPolicy {
            quick: options.tcp_quickack(),
            coalescing: options.tcp_ack_coalescing().cloned(),
        }
    }

    fn coalesces(&self) -> bool {
        self.coalescing
            .as_ref()
            .is_some_and(|on| on.load(Ordering::Relaxed))
    }
}

pub(crate) struct QuickAck {
    inner: TcpStream,
    policy: AckPolicy,
    /// We wrote since the last read: the next read is the broker's answer to it.
    wrote: bool,
    /// When an ACK last went out at our asking.
    pushed: Option<Instant>,
    /// Data read since `pushed` is owed its ACK, at `pushed + ACK_COALESCE` (`timer`).
    owed: bool,
    timer: Option<Pin<Box<Sleep>>>,
}

impl QuickAck {
    pub(crate) fn new(inner: TcpStream, policy: AckPolicy) -> Self {
        QuickAck {
            inner,
            policy,
            wrote: false,
            pushed: None,
            owed: false,
            timer: None,
        }
    }

    /// Sends the ACK the kernel holds, now; with `hold`, keeps the socket holding the next
    /// ones (delayed-ACK mode), else leaves it acknowledging each read as it drains the socket.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn push(&mut self, now: Instant, hold: bool) {
        let sock = socket2::SockRef::from(&self.inner);
        // Best effort: a socket that refuses the option just keeps delayed ACKs. 1 sends the
        // ACK that is due (and leaves delayed-ACK mode); 0 goes back to delayed-ACK mode.
        let _ = sock.set_quickack(true);
        if hold {
            let _ = sock.set_quickack(false);
        }
        self.pushed = Some(now);
        self.owed = false;
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn push(&mut self, now: Instant, _hold: bool) {
        self.pushed = Some(now);
        self.owed = false;
    }

    /// Data was read: its ACK goes out now or is owed (the module docs' rule).
    fn read_some(&mut self, cx: &mut Context<'_>) {
        let now = Instant::now();
        if !self.policy.coalesces() {
            self.push(now, false);
            self.wrote = false;
            return;
        }
        // When the next ACK may go out, if not yet.
        let not_before = self
            .pushed
            .map(|at| at + ACK_COALESCE)
            .filter(|&at| now < at);
        match not_before {
            Some(at) if !self.wrote => self.owe(at, now, cx),
            _ => self.push(now, true),
        }
        self.wrote = false;
    }

    /// The ACK of what was just read goes out at `at` (on the timer), unless one is owed already.
    fn owe(&mut self, at: Instant, now: Instant, cx: &mut Context<'_>) {
        if !self.owed {
            self.owed = true;
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())));
            timer.as_mut().reset(at.into());
            // Registers this task's waker: the owed ACK goes out even if nothing more comes.
            if timer.as_mut().poll(cx).is_ready() {
                self.push(now, true);
            }
        }
    }

    /// The owed ACK, once its time is up (polled with every read).
    fn push_owed(&mut self, cx: &mut Context<'_>) {
        if !self.owed {
            return;
        }
        let up = self
            .timer
            .as_mut()
            .is_some_and(|timer| timer.as_mut().poll(cx).is_ready());
        if up {
            self.push(Instant::now(), self.policy.coalesces());
        }
    }

    /// A segment we send carries the ACK of everything the kernel has received.
    fn wrote_if(&mut self, polled: &Poll<io::Result<usize>>) {
        if matches!(polled, Poll::Ready(Ok(n)) if *n > 0) {
            self.wrote = true;
            self.owed = false;
        }
    }
}

impl AsyncRead for QuickAck {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.policy.quick {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        self.push_owed(cx);
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.read_some(cx);
        }
        polled
    }
}

impl AsyncWrite for QuickAck {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote_if(&polled);
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote_if(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(all(test, any(target_os = "linux", target_os = "android")))]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A read through a quick stream leaves the socket acknowledging at once (quick-ACK mode),
    /// even after the client wrote in between (which is what puts Linux back into delayed
    /// ACKs), while coalescing is off; while it is on, the read's ACK went out and the socket is
    /// back in delayed-ACK mode, so that the next reads wait for the next ACK. Bytes pass
    /// unchanged, both ways. Without quick ACKs the socket is left to the kernel.
    #[tokio::test]
    async fn reads_leave_the_socket_in_the_mode_the_switch_asks_for() {
        let switch = Arc::new(AtomicBool::new(false));
        for (quick, coalescing) in [(true, false), (true, true), (false, false)] {
            switch.store(coalescing, Ordering::Relaxed);
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
            let policy = AckPolicy {
                quick,
                coalescing: Some(switch.clone()),
            };
            let mut client = QuickAck::new(client.unwrap(), policy);
            let (mut broker, _) = accepted.unwrap();
            let mut got = [0u8; 5];
            for round in 0..3u8 {
                broker.write_all(&[round; 5]).await.unwrap();
                client.read_exact(&mut got).await.unwrap();
                assert_eq!(got, [round; 5]);
                if quick {
                    let sock = socket2::SockRef::from(&client.inner);
                    assert_eq!(
                        sock.quickack().unwrap(),
                        !coalescing,
                        "round {round}: quick ACKs {}",
                        if coalescing { "held" } else { "re-armed" }
                    );
                    assert!(
                        client.pushed.is_some(),
                        "round {round}: the read was acknowledged"
                    );
                }
                client.write_all(b"ack").await.unwrap();
                let mut echo = [0u8; 3];
                broker.read_exact(&mut echo).await.unwrap();
                assert_eq!(&echo, b"ack");
            }
        }
    }
}
