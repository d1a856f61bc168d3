//! One watch, run for good: a kube-runtime watcher whose events go into the index, restarted after
//! an error, with the initial list streamed where the API server streams it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::api::Api;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};

use super::Store;
use crate::cache::InfraKindState;
use crate::cache::writer::{self as index, Prepared, Watched};
use crate::lock;
use crate::object::ApiObject;

/// The pauses before a failed watch (or a lookup of a kind not served yet) is tried again:
/// kube-runtime's default, client-go's reflector backoff (0.8 s doubling to 30 s, each pause
/// stretched by a random 0–100 %, back to the start after 2 minutes without a failure). The jitter
/// matters after an API server outage: every watch of every replica of every provider failed at
/// once, and without it they would all list again at the same instants.
/// What the backoff's longest pause can be (its 30 s stretched by the full jitter), should it ever end.
pub(super) const RESTART_LONGEST: Duration = Duration::from_secs(60);

pub(super) fn restart_backoff() -> impl Backoff {
    DefaultBackoff::default()
}

/// Objects per page of a list where the API server does not stream it: 200 round trips at 100,000
/// Machines with kube's default of 500, 20 with this, each page a few MiB held while it is parsed.
const LIST_PAGE: u32 = 5_000;

/// Whether each cluster's watches start with a streamed initial list (see [`streams_initial_lists`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streaming {
    pub management: bool,
    pub workload: bool,
}

/// Whether an API server of this version (`/version`'s major and minor, e.g. "1", "34+") streams
/// initial lists by default: the WatchList feature gate is on by default in Kubernetes 1.32 and
/// from 1.34, off in 1.33 and before. An unreadable version lists in pages, which every server
/// serves; a server with the gate turned off refuses the stream, and the watch lists in pages.
pub fn streams_initial_lists(major: &str, minor: &str) -> bool {
    let number = |s: &str| {
        s.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .ok()
    };
    matches!((number(major), number(minor)), (Some(1), Some(m)) if m == 32 || m >= 34)
}

impl Store {
    /// Runs one watch for good. After an error the watcher is dropped and started again (a fresh
    /// list) after a pause: the next complete list is what says the watch is in sync again, since a
    /// watch resumed from a resourceVersion delivers nothing when nothing changed.
    ///
    /// Where the cluster's server streams initial lists, the list comes as a stream of watch events
    /// (WatchList: the server never builds the whole list in one response, and parsing event by
    /// event costs about half the CPU of list pages). A server that refuses it (the feature off: 422,
    /// or an older server: 400) gets paginated lists from then on.
    pub(super) async fn watch<const S: bool>(
        self: Arc<Self>,
        what: Watched,
        api: Api<ApiObject<S>>,
        name: String,
    ) {
        let timeout = u32::try_from(self.watch_settings.timeout.as_secs())
            .unwrap_or(290)
            .clamp(1, 290);
        let mut streaming = match what {
            Watched::Node => self.watch_settings.streaming.workload,
            _ => self.watch_settings.streaming.management,
        };
        let mut listed_once = false;
        let mut backoff = restart_backoff();
        loop {
            let mut config = watcher::Config::default().timeout(timeout);
            config = if streaming {
                config.streaming_lists()
            } else {
                config.page_size(LIST_PAGE)
            };
            let run = self
                .follow(
                    &what,
                    &name,
                    watcher::watcher(api.clone(), config),
                    listed_once,
                )
                .await;
            if run.synced {
                listed_once = true;
                backoff.reset();
            }
            let (text, fatal) = match after_run(run.failure.as_ref(), streaming, run.synced) {
                AfterRun::ListInPages(code) => {
                    tracing::info!(watch = %name, code, "the API server does not stream initial lists (WatchList): listing in pages instead");
                    streaming = false;
                    continue;
                }
                AfterRun::Retry { text, fatal } => (text, fatal),
            };
            self.metrics.watch_event(what.label(), "error");
            self.watch_failed(&name, text.clone(), fatal);
            if let Watched::Infra(kind) = &what
                && !listed_once
            {
                lock(&self.index)
                    .set_infra_kind_state(kind.clone(), InfraKindState::Unavailable(text));
                self.wake_rebuild();
            }
            tokio::time::sleep(backoff.next().unwrap_or(RESTART_LONGEST)).await;
        }
    }

    /// Takes a watcher's events into the index until it fails or ends. `listed_before`: whether
    /// this watch has listed completely before (its first list is logged).
    async fn follow<const S: bool>(
        &self,
        what: &Watched,
        name: &str,
        stream: impl Stream<Item = watcher::Result<Event<ApiObject<S>>>>,
        listed_before: bool,
    ) -> Run {
        let mut stream = std::pin::pin!(stream);
        let mut synced = false;
        // A (re)list is parsed object by object as it arrives: only the views are held until it
        // is complete, never the JSON of every object (which is many times their size).
        let mut buffer: Vec<Prepared> = Vec::new();
        // The newest object of the (re)list: what the index is not older than once it is applied.
        let mut list_newest = 0;
        let mut list_started = Instant::now();
        let failure = loop {
            let Some(event) = stream.next().await else {
                break None;
            };
            match event {
                Ok(Event::Init) => {
                    buffer.clear();
                    list_newest = 0;
                    list_started = Instant::now();
                }
                Ok(Event::InitApply(obj)) => {
                    list_newest = list_newest.max(index::revision_of(&obj).unwrap_or(0));
                    buffer.push(index::prepare(&self.settings.keys, what, obj))
                }
                Ok(Event::InitDone) => {
                    let objects = std::mem::take(&mut buffer);
                    // What a slow start spent its time on, one line per watch.
                    if !listed_before && !synced {
                        tracing::info!(watch = %name, objects = objects.len(), took = ?list_started.elapsed(), "listed");
                    }
                    self.metrics.watch_event(what.label(), "list");
                    {
                        let mut index = lock(&self.index);
                        index::reset(&mut index, what, objects);
                        if let Some(kind) = index::watermark_kind(what) {
                            index.relisted_at(kind, list_newest);
                        }
                    }
                    self.watermark_moved.notify_waiters();
                    synced = true;
                    self.watch_synced(name);
                    self.wake_rebuild();
                }
                Ok(Event::Apply(obj)) => {
                    self.metrics.watch_event(what.label(), "apply");
                    self.take_event(what, obj, false);
                }
                Ok(Event::Delete(obj)) => {
                    self.metrics.watch_event(what.label(), "delete");
                    self.take_event(what, obj, true);
                }
                // 410 Gone: the resourceVersion is too old; the watcher lists again by itself.
                Err(e) if watch_error_code(&e) == Some(410) => {
                    self.metrics.watch_event(what.label(), "expired");
                    tracing::debug!(watch = %name, "watch expired, listing again: {}", watch_error_text(&e));
                }
                Err(e) => break Some(e),
            }
        };
        Run { failure, synced }
    }
}

impl Store {
    /// A watch event, applied to the index (`deleted`: the object is gone); its revision is how far
    /// the watch of its kind has brought the index (a deleted object carries the revision of its
    /// deletion), for the kinds a watermark is kept of ([`crate::cache::Index::watched`]).
    pub(crate) fn take_event<const S: bool>(
        &self,
        what: &Watched,
        obj: ApiObject<S>,
        deleted: bool,
    ) {
        let watermark = index::watermark_kind(what).map(|kind| (kind, index::revision_of(&obj)));
        let changed = {
            let mut index = lock(&self.index);
            let changed = if deleted {
                index::delete(&mut index, what, &obj);
                true
            } else {
                index::apply(&mut index, &self.settings.keys, what, obj)
            };
            if let Some((kind, Some(revision))) = watermark {
                index.watched_to(kind, revision);
            }
            changed
        };
        if changed {
            self.wake_rebuild();
        }
        if watermark.is_some() {
            self.watermark_moved.notify_waiters();
        }
    }
}

/// How one watcher ended.
struct Run {
    /// `None`: the stream ended without an error.
    failure: Option<watcher::Error>,
    /// It listed completely at least once.
    synced: bool,
}

/// What follows the end of a watcher.
#[derive(Debug, PartialEq, Eq)]
enum AfterRun {
    /// The API server refused a streamed initial list (with this status): list in pages instead,
    /// at once.
    ListInPages(u16),
    /// A failure to report (fatal: forbidden or not found) before starting again after a pause.
    Retry { text: String, fatal: bool },
}

/// What follows the end of a watcher that failed with `failure` (or ended), having asked for a
/// streamed initial list or not and having listed completely or not: a server that never listed
/// because it refuses the stream (the feature off: 422, or an older server: 400) is asked for pages.
fn after_run(failure: Option<&watcher::Error>, streaming: bool, synced: bool) -> AfterRun {
    if streaming
        && !synced
        && let Some(code @ (400 | 422)) = failure.and_then(watch_error_code)
    {
        return AfterRun::ListInPages(code);
    }
    match failure {
        Some(e) => AfterRun::Retry {
            text: watch_error_text(e),
            fatal: matches!(watch_error_code(e), Some(403 | 404)),
        },
        None => AfterRun::Retry {
            text: "the watch stream ended".to_string(),
            fatal: false,
        },
    }
}

/// The part of a watch error a person needs: the API's message rather than the whole status dump.
fn watch_error_text(e: &watcher::Error) -> String {
    let source = match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        watcher::Error::WatchError(status) => {
            return format!("{} ({})", status.message, status.code);
        }
        other => return other.to_string(),
    };
    match source {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
        other => with_causes(other),
    }
}

/// An error with its causes (`client error (Connect): tcp connect error: Connection refused`): the
/// outermost alone rarely says what went wrong.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// The HTTP status code of a watch error that came from the API server.
fn watch_error_code(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(name: &str, version: &str) -> ApiObject {
        ApiObject::from_json(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": name, "namespace": "ns", "uid": name, "resourceVersion": version},
            "spec": {"clusterName": "c1"},
        }))
        .expect("a Machine")
    }

    /// What a read may take the cache's Machines for: how far the Machines watch brought them, from
    /// its lists (the newest object listed: the list is not older) and its events (a deletion's
    /// revision included); a relist answered older than the events before it lowers it.
    #[tokio::test]
    async fn the_machines_watch_says_how_far_it_has_brought_the_cache() {
        let (service, _api) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let store = Store::fixed(
            kube::Client::new(service, "ns"),
            crate::apis::CapiApis::assume(crate::capi::DEFAULT_GROUP, "v1beta2"),
            crate::snapshot::Settings::default(),
            crate::cache::Index::default(),
            Arc::new(crate::metrics::Metrics::new()),
        );
        let watched = |store: &Store| lock(&store.index).watched(None);
        let follow = |events: Vec<Event<ApiObject>>| {
            let store = Arc::clone(&store);
            async move {
                let events = futures::stream::iter(events.into_iter().map(Ok));
                store
                    .follow(&Watched::Machine, "machines", events, false)
                    .await;
            }
        };

        follow(vec![
            Event::Init,
            Event::InitApply(machine("a", "7")),
            Event::InitApply(machine("b", "5")),
            Event::InitDone,
        ])
        .await;
        assert_eq!(watched(&store), 7);
        let deadline = Instant::now() + Duration::from_millis(50);
        assert_eq!(store.watched_from(None, 7, deadline).await, Some(7));
        assert_eq!(store.watched_from(None, 8, Instant::now()).await, None);

        let waiting = tokio::spawn({
            let store = Arc::clone(&store);
            async move {
                let deadline = Instant::now() + Duration::from_secs(30);
                store.watched_from(None, 15, deadline).await
            }
        });
        follow(vec![
            Event::Apply(machine("c", "12")),
            Event::Delete(machine("a", "15")),
        ])
        .await;
        assert_eq!(waiting.await.ok().flatten(), Some(15), "woken by the event");
        assert!(
            lock(&store.index)
                .machine(&crate::capi::ObjectKey::new("ns", "a"))
                .is_none()
        );

        follow(vec![
            Event::Init,
            Event::InitApply(machine("b", "5")),
            Event::InitDone,
        ])
        .await;
        assert_eq!(watched(&store), 5);
    }

    /// Where the n-th pause may fall: 0.8 s doubling to 30 s, stretched by up to 100 %.
    fn pause_bounds(n: u32) -> (Duration, Duration) {
        let base = Duration::from_millis(800)
            .saturating_mul(2u32.saturating_pow(n))
            .min(Duration::from_secs(30));
        (base, base * 2)
    }

    #[tokio::test]
    async fn watches_that_failed_together_restart_at_different_instants() {
        // An API server outage fails every watch at once; each restarts on a backoff of its own.
        let pauses: Vec<Vec<Duration>> = (0..4)
            .map(|_| restart_backoff().take(8).collect())
            .collect();
        for p in &pauses {
            for (n, pause) in p.iter().enumerate() {
                let (low, high) = pause_bounds(n as u32);
                assert!(
                    *pause >= low && *pause <= high,
                    "pause {n}: {pause:?} outside [{low:?}, {high:?}]"
                );
            }
        }
        for (i, a) in pauses.iter().enumerate() {
            for b in &pauses[i + 1..] {
                assert_ne!(a, b, "two watches would restart in lockstep");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_starts_over_after_a_sync_or_two_quiet_minutes() {
        let mut backoff = restart_backoff();
        for _ in 0..5 {
            backoff.next();
        }
        backoff.reset();
        let (low, high) = pause_bounds(0);
        let first = backoff.next().expect("a pause");
        assert!(first >= low && first <= high, "{first:?}");
        for _ in 0..5 {
            backoff.next();
        }
        tokio::time::advance(Duration::from_secs(121)).await;
        let after_quiet = backoff.next().expect("a pause");
        assert!(after_quiet >= low && after_quiet <= high, "{after_quiet:?}");
    }

    #[test]
    fn initial_lists_are_streamed_only_where_the_server_streams_them_by_default() {
        for (major, minor, streams) in [
            ("1", "36", true),
            ("1", "34", true),
            ("1", "34+", true),
            ("1", "33", false),
            ("1", "32", true),
            ("1", "31", false),
            ("1", "27", false),
            ("2", "0", false),
            ("1", "", false),
            ("", "", false),
            ("one", "thirty-four", false),
        ] {
            assert_eq!(
                streams_initial_lists(major, minor),
                streams,
                "{major}.{minor}"
            );
        }
    }

    fn refused(code: u16, message: &str) -> watcher::Error {
        let status = kube::core::Status::failure(message, "").with_code(code);
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(status)))
    }

    #[test]
    fn a_server_that_refuses_the_streamed_list_before_any_list_is_asked_for_pages() {
        for code in [400, 422] {
            let e = refused(code, "unsupported");
            assert_eq!(
                after_run(Some(&e), true, false),
                AfterRun::ListInPages(code)
            );
            // Once it listed, or when pages were asked for, the same refusal is a failure.
            for (streaming, synced) in [(true, true), (false, false)] {
                assert_eq!(
                    after_run(Some(&e), streaming, synced),
                    AfterRun::Retry {
                        text: format!("unsupported ({code})"),
                        fatal: false
                    },
                    "streaming {streaming}, synced {synced}"
                );
            }
        }
    }

    #[test]
    fn forbidden_and_not_found_are_fatal_other_failures_are_not() {
        for (code, fatal) in [(403, true), (404, true), (500, false), (429, false)] {
            let e = refused(code, "machines is refused");
            assert_eq!(
                after_run(Some(&e), false, true),
                AfterRun::Retry {
                    text: format!("machines is refused ({code})"),
                    fatal
                },
                "{code}"
            );
        }
        let status = kube::core::Status::failure("too old", "Expired").with_code(410);
        let during = watcher::Error::WatchError(Box::new(status));
        assert_eq!(watch_error_code(&during), Some(410));
        assert_eq!(watch_error_text(&during), "too old (410)");
        assert_eq!(
            after_run(None, true, false),
            AfterRun::Retry {
                text: "the watch stream ended".into(),
                fatal: false
            }
        );
        assert_eq!(watch_error_code(&watcher::Error::NoResourceVersion), None);
    }
}
