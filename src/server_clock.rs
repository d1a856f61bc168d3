//! The API server's clock, as the `Date` header of its answers shows it: the one clock every
//! provider replica can share. A removal's stamp is a time on it, and the repair ages records by it
//! (`crate::protocol::Ripe::Aged`), so no decision compares two providers' clocks, and a provider
//! that just started ages a record as one that saw it written would.
//!
//! Between answers, the time is the last `Date` plus this process's monotonic time since it came:
//! a duration, never another machine's reading. With several API servers behind one address it is
//! the clock of the one that answered last.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::HeaderMap;

use crate::lock;

#[derive(Clone, Debug, Default)]
pub struct ServerClock {
    /// The last `Date` (Unix seconds) and when it came.
    last: Arc<Mutex<Option<(u64, Instant)>>>,
}

impl ServerClock {
    /// Notes the `Date` of an answer; an answer without one, or with one that is no HTTP date, is
    /// ignored.
    pub fn saw(&self, headers: &HeaderMap) {
        let Some(date) = headers
            .get(http::header::DATE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| httpdate::parse_http_date(v).ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        else {
            return;
        };
        *lock(&self.last) = Some((date.as_secs(), Instant::now()));
    }

    /// The server's time now, in Unix seconds, never later than it is: what the repair ages records
    /// against (a record looks younger, never older, than it is).
    pub fn now(&self) -> u64 {
        match *lock(&self.last) {
            Some((date, at)) => date.saturating_add(at.elapsed().as_secs()),
            None => local_now().as_secs(),
        }
    }

    /// The server's time now, in Unix seconds, never earlier than it is: what a removal stamps its
    /// records with (a `Date` is whole seconds, cut down).
    pub fn stamp(&self) -> u64 {
        match *lock(&self.last) {
            Some((date, at)) => date.saturating_add(whole_secs(at.elapsed()) + 1),
            None => whole_secs(local_now()),
        }
    }

    /// Whether an answer of the API server has been seen: before that (a client that is no
    /// real API server's), both times are this machine's clock.
    #[cfg(test)]
    pub fn is_set(&self) -> bool {
        lock(&self.last).is_some()
    }
}

fn local_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Whole seconds a duration spans, rounded up: a grace period of 1.5 s waits 2.
pub fn whole_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn date(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::DATE, value.parse().unwrap());
        headers
    }

    // 2026-01-01T00:00:00Z
    const NEW_YEAR: u64 = 1_767_225_600;

    #[test]
    fn the_time_is_the_last_answers_date_whatever_this_machines_clock_says() {
        let clock = ServerClock::default();
        clock.saw(&date("Thu, 01 Jan 2026 00:00:00 GMT"));
        assert!(clock.is_set());
        // This machine's clock reads 2026-11 or later; the server's is what counts.
        assert_eq!(clock.now(), NEW_YEAR);
        // A Date is cut down to the second: the stamp is after the true time, the now never after it.
        assert!((NEW_YEAR + 1..=NEW_YEAR + 2).contains(&clock.stamp()));
        clock.saw(&date("Thu, 01 Jan 2026 00:01:00 GMT"));
        assert_eq!(clock.now(), NEW_YEAR + 60);
    }

    #[test]
    fn an_answer_without_a_date_or_with_a_bad_one_changes_nothing() {
        let clock = ServerClock::default();
        clock.saw(&HeaderMap::new());
        clock.saw(&date("yesterday"));
        assert!(!clock.is_set());
        clock.saw(&date("Thu, 01 Jan 2026 00:00:00 GMT"));
        clock.saw(&date("not a date"));
        assert_eq!(clock.now(), NEW_YEAR);
    }

    #[test]
    fn before_any_answer_both_times_are_this_machines() {
        let clock = ServerClock::default();
        let local = local_now().as_secs();
        assert!((local..=local + 1).contains(&clock.now()));
        assert!((local..=local + 2).contains(&clock.stamp()));
        assert!(clock.stamp() >= clock.now());
    }

    #[test]
    fn a_grace_period_counts_whole_seconds_rounded_up() {
        assert_eq!(whole_secs(Duration::ZERO), 0);
        assert_eq!(whole_secs(Duration::from_millis(1500)), 2);
        assert_eq!(whole_secs(Duration::from_secs(30)), 30);
    }
}
