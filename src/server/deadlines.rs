//! The deadlines of the calls that wait (for a permit, for the rest of their request, for their
//! answer), checked on the ticks of one clock: a waiting call is woken by each tick and looks at its
//! own deadline. A timer per call would be registered for every call that waits at all (a fifth of
//! the reads: their request's last bytes are not there yet when they are first polled), and each
//! registration wakes the runtime's driver thread: a system call and a thread switch per call. The
//! clock ticks only while calls wait, and stops a second after the last one.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How long the clock keeps ticking with no call waiting.
const LINGER: Duration = Duration::from_secs(1);

/// One clock for the calls of a server.
#[derive(Clone)]
pub struct Deadlines {
    clock: Arc<Clock>,
}

struct Clock {
    tick: Duration,
    ticks: Notify,
    /// Calls waiting on a tick now.
    waiting: AtomicUsize,
    /// Whether a task is ticking.
    running: AtomicBool,
}

impl Deadlines {
    /// A clock ticking every `tick` while calls wait: a deadline is seen at most a tick late.
    pub fn new(tick: Duration) -> Deadlines {
        Deadlines {
            clock: Arc::new(Clock {
                tick: tick.max(Duration::from_millis(1)),
                ticks: Notify::new(),
                waiting: AtomicUsize::new(0),
                running: AtomicBool::new(false),
            }),
        }
    }

    /// The tick for calls answered within `timeout`: a twentieth of it, between 5 and 200 ms, so a
    /// call is answered within 1.05 × `timeout` (and CA's 5 s after the default 4 s).
    pub fn for_timeout(timeout: Duration) -> Deadlines {
        Deadlines::new((timeout / 20).clamp(Duration::from_millis(5), Duration::from_millis(200)))
    }

    /// `future`'s output, or `None` when `deadline` passes first (seen within a tick). A future
    /// that is ready when first polled touches no clock.
    pub async fn before<F: Future>(&self, deadline: Instant, future: F) -> Option<F::Output> {
        let mut future = pin!(future);
        if let Poll::Ready(output) =
            std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
        {
            return Some(output);
        }
        let _waiting = Waiting::new(&self.clock);
        loop {
            let mut tick = pin!(self.clock.ticks.notified());
            // Registered before the deadline is looked at: no tick between the two is missed.
            tick.as_mut().enable();
            if Instant::now() >= deadline {
                return None;
            }
            // A tick first: when the deadline passed, the call is given up even if its future
            // became ready with the same wake-up (a permit handed over by a call that gave up).
            tokio::select! {
                biased;
                () = &mut tick => {}
                output = &mut future => return Some(output),
            }
        }
    }

    /// Calls waiting on a tick now.
    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        self.clock.waiting.load(Ordering::SeqCst)
    }

    /// Whether the clock ticks.
    #[cfg(test)]
    fn ticking(&self) -> bool {
        self.clock.running.load(Ordering::SeqCst)
    }
}

/// A call counted among the waiting while it lives; the first one after a quiet spell starts the
/// clock.
struct Waiting<'a>(&'a Arc<Clock>);

impl<'a> Waiting<'a> {
    fn new(clock: &'a Arc<Clock>) -> Waiting<'a> {
        clock.waiting.fetch_add(1, Ordering::SeqCst);
        if !clock.running.swap(true, Ordering::SeqCst) {
            tokio::spawn(tick(Arc::clone(clock)));
        }
        Waiting(clock)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Wakes the waiting calls every tick; returns after [`LINGER`] with none waiting.
async fn tick(clock: Arc<Clock>) {
    let mut quiet = Duration::ZERO;
    loop {
        tokio::time::sleep(clock.tick).await;
        clock.ticks.notify_waiters();
        if clock.waiting.load(Ordering::SeqCst) > 0 {
            quiet = Duration::ZERO;
            continue;
        }
        quiet += clock.tick;
        if quiet < LINGER {
            continue;
        }
        clock.running.store(false, Ordering::SeqCst);
        // A call that began to wait after the count was read, and saw the clock still running,
        // started none: this task goes on for it (unless another has started since).
        if clock.waiting.load(Ordering::SeqCst) == 0 || clock.running.swap(true, Ordering::SeqCst) {
            return;
        }
        quiet = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_ready_future_is_answered_without_the_clock() {
        let deadlines = Deadlines::new(Duration::from_millis(5));
        let answer = deadlines
            .before(Instant::now() + Duration::from_secs(1), async { 7 })
            .await;
        assert_eq!(answer, Some(7));
        assert!(
            !deadlines.ticking(),
            "no clock for a call that did not wait"
        );
        assert_eq!(deadlines.waiting(), 0);
    }

    #[tokio::test]
    async fn a_waiting_future_is_answered_when_it_is_ready() {
        let deadlines = Deadlines::new(Duration::from_millis(5));
        let (send, receive) = tokio::sync::oneshot::channel();
        let waiting = deadlines.clone();
        let call = tokio::spawn(async move {
            waiting
                .before(Instant::now() + Duration::from_secs(30), receive)
                .await
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while deadlines.waiting() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the call never waited"
            );
            tokio::task::yield_now().await;
        }
        assert!(deadlines.ticking());
        send.send(3).unwrap();
        assert_eq!(call.await.unwrap(), Some(Ok(3)));
        assert_eq!(deadlines.waiting(), 0);
    }

    #[tokio::test]
    async fn a_future_not_ready_by_its_deadline_is_given_up_within_a_tick_then_the_clock_stops() {
        let tick = Duration::from_millis(20);
        let deadlines = Deadlines::new(tick);
        let started = Instant::now();
        let answer = deadlines
            .before(
                started + Duration::from_millis(100),
                std::future::pending::<()>(),
            )
            .await;
        let waited = started.elapsed();
        assert_eq!(answer, None);
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(
            waited < Duration::from_millis(100) + 10 * tick,
            "{waited:?}"
        );
        assert_eq!(deadlines.waiting(), 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while deadlines.ticking() {
            assert!(
                std::time::Instant::now() < deadline,
                "the clock still ticks with nobody waiting"
            );
            tokio::time::sleep(tick).await;
        }
    }

    #[tokio::test]
    async fn calls_waiting_together_each_get_their_own_deadline() {
        let deadlines = Deadlines::new(Duration::from_millis(5));
        let start = Instant::now();
        let short = deadlines.before(
            start + Duration::from_millis(30),
            std::future::pending::<()>(),
        );
        let long = deadlines.before(start + Duration::from_millis(150), async {
            tokio::time::sleep(Duration::from_millis(60)).await;
            "answered"
        });
        let (short, long) = tokio::join!(short, long);
        assert_eq!(short, None);
        assert_eq!(long, Some("answered"));
    }
}
