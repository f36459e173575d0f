//! The ingest task: owns the MQTT sessions and the [`Batcher`](crate::batcher::Batcher). It
//! decodes every PUBLISH, merges its readings into the open batch, hands due batches to the
//! writer thread, and sends the acknowledgements of a batch, in arrival order, once the writer
//! reports it committed.
//!
//! Nothing inside the loop blocks: decoding and merging are in-memory, the writer runs on its own
//! thread, and acks go through `try_ack` into a request channel sized for two full windows. When
//! the open batch is full while a commit runs, the loop stops reading from the broker until the
//! commit ends (backpressure: the broker holds the rest).
//!
//! With `mqtt.sessions = N` the loop drives N connections (one shared subscription) the same
//! way: one batch and one commit for all of them; each ack goes back on the session, and the
//! connection, its message came on.
//!
//! After a reconnect, the broker's resends (DUP) are held, their acks in the batch in arrival
//! order, until their burst ends: at the first new message, after [`crate::limits::RESEND_QUIET_MIN`] (or four
//! handshake times) without a resend, or at `mqtt.receive_maximum` held; no batch is handed over
//! meanwhile. Then they are admitted in order, told apart by [`crate::resend`].

//!
//! Two layers: [`core`] is the state machine (events and an explicit `now` in, actions out; no
//! I/O), and [`Ingest`] below is its shell, the only I/O: it waits on the broker clients, the
//! writer, flush requests, timers and shutdown, feeds what happens to the core and does what
//! the core asks.

pub mod core;
pub mod host_state;
mod lag;

use std::sync::atomic::Ordering;
use std::task::Poll;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::ack::SessionId;
use crate::http::FlushRequest;
use crate::limits::SHUTDOWN_DRAIN_MAX;
use crate::link::{MqttEvent, PollError};
use crate::mqtt::Mqtt;
use crate::reading::Timestamp;
use crate::stats::Stats;
use crate::store::CommitError;
use crate::writer::Writer;

pub use self::core::{Action, Core, Event, Now, Outgoing, Parts};

/// Why ingestion stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("commit failed; nothing of the failed batch was acknowledged: {0}")]
    Commit(#[from] CommitError),
    #[error(
        "the writer thread stopped (its error is logged above); nothing it had not committed \
         was acknowledged"
    )]
    WriterGone,
}

/// The ingest task: the core and what it talks to.
pub struct Ingest {
    pub core: Core<FlushRequest>,
    /// The sessions' clients, indexed by [`SessionId`].
    pub clients: Vec<Mqtt>,
    pub stats: std::sync::Arc<Stats>,
    pub writer: Writer,
    /// `POST /api/v1/flush`: commit everything pending now.
    pub flush_requests: mpsc::Receiver<FlushRequest>,
}

/// Both clocks, read now.
fn now() -> Now {
    Now {
        at: std::time::Instant::now(),
        wall: Timestamp::now(),
        lag: std::time::Duration::ZERO,
    }
}

impl Ingest {
    /// Runs until `cancel`, then commits what is pending, acknowledges it and disconnects.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), IngestError> {
        // Pinged from this loop, not from a task of its own: if the loop stops turning, systemd
        // stops hearing from it and restarts the service.
        let mut watchdog = crate::notify::watchdog_interval().map(|every| {
            info!(every = ?every, "Pinging the systemd watchdog.");
            let mut interval = tokio::time::interval(every);
            // Ticks missed while not yet ready are not made up in a burst.
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        let mut actions = Vec::new();
        let mut turn = 0usize;
        let mut lag = lag::Lag::default();
        loop {
            self.core.tick(now(), &mut actions);
            self.act(&mut actions)?;
            let wake = self.core.wake_at().map(Instant::from_std);
            let reads = self.core.reads();
            let committing = self.core.committing();
            let ready = self.core.is_ready();
            let polled = self.polled(Core::polls);
            turn = turn.wrapping_add(1);
            if self.core.wants_lag() {
                lag.start();
            }
            let event = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                // Watched while idle too: a writer that stopped (a damaged file found by a
                // checkpoint) stops the daemon at once, not at the next commit (issue 51).
                result = self.writer.results.recv() => {
                    match result {
                        Some(result) if committing => Event::Committed(result?),
                        _ => return Err(IngestError::WriterGone),
                    }
                }
                () = sleep_until_opt(wake), if wake.is_some() => continue,
                Some(reply) = self.flush_requests.recv() => Event::Flush(reply),
                // systemd arms the watchdog once the service is ready.
                () = tick_opt(&mut watchdog), if watchdog.is_some() && ready => {
                    crate::notify::watchdog();
                    continue;
                }
                (session, event) = poll_any(&mut self.clients, turn, |i| polled.has(i)), if reads => {
                    Event::Mqtt(session, event)
                }
            };
            let now = Now {
                lag: lag.take(),
                ..now()
            };
            self.core.handle(event, now, &mut actions);
            self.act(&mut actions)?;
        }
        self.shut_down().await
    }

    /// Which sessions' clients to poll, by `pick` (taken before waiting: the core is not
    /// shared across the wait).
    fn polled(&self, pick: impl Fn(&Core<FlushRequest>, SessionId) -> bool) -> Sessions {
        let mut set = Sessions(0);
        for s in self.core.session_ids().filter(|&s| pick(&self.core, s)) {
            // At most `config::SESSIONS_MAX` (16) sessions: each has its bit.
            set.0 |= 1u32.checked_shl(u32::from(s.get())).unwrap_or(0);
        }
        set
    }

    /// Does what the core asked, then gives each client the acks and pings it has room for.
    fn act(&mut self, actions: &mut Vec<Action<FlushRequest>>) -> Result<(), IngestError> {
        for action in actions.drain(..) {
            match action {
                Action::Resume(s) => self.clients[s.index()].resume(),
                Action::Subscribe(s) => {
                    if let Err(e) = self.clients[s.index()].subscribe_all() {
                        tracing::error!(session = s.index(), error = %e, "Could not queue the subscription request.");
                    }
                }
                // Never full: one batch at the writer at a time (the core sends one only when
                // the last is answered).
                Action::Write(batch) => self
                    .writer
                    .batches
                    .try_send(batch)
                    .map_err(|_| IngestError::WriterGone)?,
                Action::Answer(reply, readings) => {
                    let _ = reply.send(readings); // The requester may have given up.
                }
                Action::Ready => crate::notify::ready(),
                Action::Publish(s, topic, payload) => {
                    if let Err(e) = self.clients[s.index()].try_publish(&topic, payload) {
                        tracing::warn!(session = s.index(), topic, error = %e, "Could not queue a Sparkplug rebirth request; the next unknown alias asks again.");
                    }
                }
            }
        }
        let acks_wait = self.core.acks_may_wait();
        for (id, client) in SessionId::all(self.clients.len()).zip(&self.clients) {
            client.set_ack_coalescing(acks_wait);
            while let Some(what) = self.core.outgoing(id) {
                let taken = match &what {
                    Outgoing::Ack(ack) => client.try_ack(ack).is_ok(),
                    Outgoing::Ping => client.try_ping().is_ok(),
                };
                self.core.taken(id, what, taken);
                if !taken || what == Outgoing::Ping {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Shutdown: commit the commit in flight and the open batch, acknowledge them, wait until
    /// the acks are written, then disconnect. Messages arriving meanwhile are not acknowledged;
    /// the broker keeps them for the next start.
    async fn shut_down(mut self) -> Result<(), IngestError> {
        let deadline = Instant::now() + SHUTDOWN_DRAIN_MAX;
        crate::notify::stopping();
        self.core.begin_drain();
        let mut actions = Vec::new();
        while !self.core.drain(std::time::Instant::now(), &mut actions) {
            self.act(&mut actions)?;
            // Keep polling while the commit runs so the connections stay alive.
            let polled = self.polled(Core::polls);
            let any_connected = polled.0 != 0;
            let event = tokio::select! {
                result = self.writer.results.recv() => {
                    Event::Committed(result.ok_or(IngestError::WriterGone)??)
                }
                (session, event) = poll_any(&mut self.clients, 0, |s| polled.has(s)), if any_connected => {
                    Event::Mqtt(session, event)
                }
            };
            self.core.handle(event, now(), &mut actions);
            self.act(&mut actions)?;
        }
        while self.core.session_ids().any(|s| self.core.owes_acks(s)) {
            let owing = self.polled(Core::owes_acks);
            let polled = poll_any(&mut self.clients, 0, |s| owing.has(s));
            if let Ok((session, event)) = tokio::time::timeout_at(deadline, polled).await {
                self.core
                    .handle(Event::Mqtt(session, event), now(), &mut actions);
                self.act(&mut actions)?;
            } else {
                warn!(
                    unwritten = self.core.acks_owed(),
                    "Gave up waiting for acknowledgements to reach the broker; it will \
                     redeliver those messages."
                );
                break;
            }
        }
        self.disconnect(deadline).await;
        self.stats.connected.store(false, Ordering::Relaxed);
        info!("Shut down cleanly.");
        Ok(())
    }

    /// Polls each connected session until its DISCONNECT is written (its event loop then
    /// reports an error or goes quiet), until `deadline`.
    async fn disconnect(&mut self, deadline: Instant) {
        let mut closing: Vec<bool> = SessionId::all(self.clients.len())
            .zip(&self.clients)
            .map(|(id, c)| self.core.is_up(id) && c.try_disconnect().is_ok())
            .collect();
        let written = tokio::time::timeout_at(deadline, async {
            while closing.iter().any(|c| *c) {
                let open = closing.clone();
                let (session, event) = poll_any(&mut self.clients, 0, |s| open[s.index()]).await;
                if matches!(event, Err(_) | Ok(MqttEvent::DisconnectSent)) {
                    closing[session.index()] = false;
                }
            }
        })
        .await;
        if written.is_err() {
            warn!("Timed out sending DISCONNECT to the broker.");
        }
    }
}

/// A set of sessions, a bit each.
#[derive(Clone, Copy)]
struct Sessions(u32);

impl Sessions {
    fn has(self, s: SessionId) -> bool {
        self.0
            .checked_shr(u32::from(s.get()))
            .is_some_and(|b| b & 1 == 1)
    }
}

/// An event and the session it came from.
type Polled = (SessionId, Result<MqttEvent, PollError>);

/// The first event of the clients that `pick(session)` selects, with its session. Turns rotate
/// with `turn`, so that a busy session cannot starve the others. Cancel-safe.
async fn poll_any(
    clients: &mut [Mqtt],
    turn: usize,
    mut pick: impl FnMut(SessionId) -> bool,
) -> Polled {
    let n = clients.len();
    std::future::poll_fn(|cx| {
        for k in 0..n {
            let i = (turn + k) % n;
            let Some(id) = SessionId::from_index(i) else {
                continue;
            };
            if pick(id)
                && let Poll::Ready(event) = clients[i].poll_event(cx)
            {
                return Poll::Ready((id, event));
            }
        }
        Poll::Pending
    })
    .await
}

async fn tick_opt(interval: &mut Option<tokio::time::Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
