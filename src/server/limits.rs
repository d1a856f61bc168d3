//! Limits on every CloudProvider call, as a tower layer around the gRPC routes: at most
//! `--max-concurrent-requests` at a time, each answered within `--request-timeout`. The request's
//! size is the gRPC library's to refuse (`--max-message-size`, read from the message's own header,
//! before its bytes) and its decoded size the codec's (`crate::grpc::codec`); this layer gives
//! their refusals the code and the count an operator reads: `RESOURCE_EXHAUSTED`, and
//! `grpc_rejected_total` with the limit's reason.
//!
//! Nothing here touches the request: a call that is ready at once (most reads) costs a permit and
//! a look at its answer's headers.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use tokio::sync::Semaphore;
use tonic::body::Body;

use super::deadlines::Deadlines;
use crate::grpc::codec::{TOO_LARGE_DECODED, carries_nodes};
use crate::metrics::Metrics;
use crate::proto::METHODS;

/// The CloudProvider service's path prefix; health and reflection are not limited.
pub(super) const CLOUD_PROVIDER: &str =
    "/clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider/";

/// Limits on every CloudProvider call. One `Arc`: each call takes one reference.
#[derive(Clone)]
pub struct Limits(Arc<Bounds>);

struct Bounds {
    max_message: usize,
    timeout: Duration,
    permits: Semaphore,
    concurrency: usize,
    deadlines: Deadlines,
    metrics: Arc<Metrics>,
}

impl Limits {
    /// `max_message` is the limit the gRPC library is given (named in the refusal).
    pub fn new(
        max_message: usize,
        concurrency: usize,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let concurrency = concurrency.clamp(1, Semaphore::MAX_PERMITS);
        Limits(Arc::new(Bounds {
            max_message,
            timeout,
            permits: Semaphore::new(concurrency),
            concurrency,
            deadlines: Deadlines::for_timeout(timeout),
            metrics,
        }))
    }
}

impl Bounds {
    fn reject(
        &self,
        method: &'static str,
        reason: &'static str,
        status: tonic::Status,
    ) -> http::Response<Body> {
        self.count_rejection(method, reason, &status);
        status.into_http()
    }

    fn count_rejection(&self, method: &'static str, reason: &'static str, status: &tonic::Status) {
        self.metrics.rejected(method, reason);
        self.metrics.rpc(method, status.code(), Duration::ZERO);
        tracing::warn!(method, reason, "{}", status.message());
    }

    /// `response` as CA gets it. An error answered before the handler ran is a limit's refusal:
    /// the library answers a message over its limit `OUT_OF_RANGE` (which no handler answers), the
    /// codec a request too large decoded with [`TOO_LARGE_DECODED`].
    fn answer(&self, method: &'static str, response: http::Response<Body>) -> http::Response<Body> {
        // An answer's status is in its trailers; one in the headers is an error answered at once.
        if !response.headers().contains_key("grpc-status") {
            return response;
        }
        let Some(status) = tonic::Status::from_header_map(response.headers()) else {
            return response;
        };
        match status.code() {
            tonic::Code::OutOfRange => self.reject(
                method,
                "message-size",
                tonic::Status::resource_exhausted(format!(
                    "{method}: the request is larger than --max-message-size ({} bytes)",
                    self.max_message
                )),
            ),
            tonic::Code::ResourceExhausted
                if carries_nodes(method)
                    && status
                        .message()
                        .strip_prefix(method)
                        .and_then(|rest| rest.strip_prefix(": "))
                        .is_some_and(|rest| rest.starts_with(TOO_LARGE_DECODED)) =>
            {
                self.count_rejection(method, "decoded-size", &status);
                response
            }
            _ => response,
        }
    }
}

impl<S> tower::Layer<S> for Limits {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limits: self.clone(),
        }
    }
}

/// The gRPC routes behind [`Limits`].
#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    limits: Limits,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<Body>> for Limited<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let method = request
            .uri()
            .path()
            .strip_prefix(CLOUD_PROVIDER)
            .map(|name| {
                METHODS
                    .into_iter()
                    .find(|m| *m == name)
                    .unwrap_or("unknown")
            });
        // Calling the routes only picks the route; the handler's work is in the future, polled
        // after the permit (a call refused before it never reaches the handler: the concurrency
        // test). Made here, it needs no clone of the routes moved into this call's future.
        let answer = self.inner.call(request);
        let Some(method) = method else {
            return Box::pin(answer);
        };
        let limits = Arc::clone(&self.limits.0);
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + limits.timeout;
            // A free permit is taken at once; else the call waits for one, within its deadline.
            let _permit = match limits.permits.try_acquire() {
                Ok(permit) => permit,
                Err(_) => match limits
                    .deadlines
                    .before(deadline, limits.permits.acquire())
                    .await
                {
                    Some(Ok(permit)) => permit,
                    Some(Err(_)) | None => {
                        return Ok(limits.reject(
                            method,
                            "concurrency",
                            tonic::Status::unavailable(format!(
                                "{method}: {} calls in progress (--max-concurrent-requests) for longer than {:?}; retry",
                                limits.concurrency, limits.timeout
                            )),
                        ));
                    }
                },
            };
            match limits.deadlines.before(deadline, answer).await {
                Some(Ok(response)) => Ok(limits.answer(method, response)),
                Some(Err(never)) => match never {},
                None => Ok(limits.reject(
                    method,
                    "timeout",
                    tonic::Status::deadline_exceeded(format!(
                        "{method}: not answered within {:?} (--request-timeout): a request still arriving is dropped; a scale operation that was accepted goes on to completion, retry to see its outcome",
                        limits.timeout
                    )),
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;
    use tower::{Layer, Service as _};

    /// Stands in for the gRPC routes: reads the request, waits `delay`, answers `answer` (OK when
    /// `None`).
    #[derive(Clone)]
    struct Routes {
        delay: Duration,
        answer: Option<tonic::Status>,
        called: Arc<AtomicUsize>,
        body_len: Arc<AtomicUsize>,
    }

    impl tower::Service<http::Request<Body>> for Routes {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

        fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<Body>) -> Self::Future {
            let me = self.clone();
            Box::pin(async move {
                me.called.fetch_add(1, Ordering::SeqCst);
                let body = request.into_body().collect().await.unwrap().to_bytes();
                me.body_len.store(body.len(), Ordering::SeqCst);
                tokio::time::sleep(me.delay).await;
                Ok(me
                    .answer
                    .clone()
                    .unwrap_or_else(|| tonic::Status::ok(""))
                    .into_http())
            })
        }
    }

    fn routes(delay: Duration) -> Routes {
        answering(delay, None)
    }

    fn answering(delay: Duration, answer: Option<tonic::Status>) -> Routes {
        Routes {
            delay,
            answer,
            called: Arc::new(AtomicUsize::new(0)),
            body_len: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn limits(concurrency: usize, timeout: Duration) -> Limits {
        Limits::new(1 << 20, concurrency, timeout, Arc::new(Metrics::new()))
    }

    /// A unary gRPC request to `method` carrying `message`.
    fn call(method: &str, message: &[u8]) -> http::Request<Body> {
        let mut framed = vec![0u8];
        framed.extend((message.len() as u32).to_be_bytes());
        framed.extend_from_slice(message);
        http::Request::post(format!("{CLOUD_PROVIDER}{method}"))
            .body(Body::new(http_body_util::Full::new(
                prost::bytes::Bytes::from(framed),
            )))
            .unwrap()
    }

    fn status(response: &http::Response<Body>) -> tonic::Status {
        tonic::Status::from_header_map(response.headers()).unwrap_or_else(|| tonic::Status::ok(""))
    }

    fn code(response: &http::Response<Body>) -> tonic::Code {
        status(response).code()
    }

    #[tokio::test]
    async fn a_normal_call_passes_whole() {
        let inner = routes(Duration::ZERO);
        let mut svc = limits(4, Duration::from_secs(1)).layer(inner.clone());
        let response = svc
            .call(call("NodeGroupDeleteNodes", &[0x12, 0x01, b'x']))
            .await
            .unwrap();
        assert_eq!(code(&response), tonic::Code::Ok);
        assert_eq!(inner.body_len.load(Ordering::SeqCst), 8);
    }

    /// The library refuses a message over its limit with OUT_OF_RANGE: CA gets RESOURCE_EXHAUSTED
    /// naming the flag, and the refusal is counted.
    #[tokio::test]
    async fn a_message_over_the_size_limit_is_refused_resource_exhausted_and_counted() {
        let refused = tonic::Status::out_of_range(
            "Error, decoded message length too large: found 2000000 bytes, the limit is: 1048576 bytes",
        );
        let inner = answering(Duration::ZERO, Some(refused));
        let metrics = Arc::new(Metrics::new());
        let mut svc =
            Limits::new(1 << 20, 4, Duration::from_secs(1), Arc::clone(&metrics)).layer(inner);
        let response = svc.call(call("NodeGroupTargetSize", &[])).await.unwrap();
        let status = status(&response);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "NodeGroupTargetSize: the request is larger than --max-message-size (1048576 bytes)"
        );
        let text = metrics.encode();
        assert!(
            text.contains(
                "grpc_rejected_total{method=\"NodeGroupTargetSize\",reason=\"message-size\"} 1"
            ),
            "{text}"
        );
    }

    /// The codec refuses a request that carries too many nodes: CA gets its answer as it is, and
    /// the refusal is counted; the same code from another method, or with another message, is an
    /// answer like any other.
    #[tokio::test]
    async fn a_request_too_large_decoded_is_counted_as_refused() {
        let too_large = tonic::Status::resource_exhausted(format!(
            "NodeGroupDeleteNodes: {TOO_LARGE_DECODED}: more than 67108864 bytes"
        ));
        for (method, answer, counted) in [
            ("NodeGroupDeleteNodes", too_large.clone(), true),
            ("PricingPodPrice", too_large, false),
            (
                "NodeGroupDeleteNodes",
                tonic::Status::resource_exhausted("something else"),
                false,
            ),
        ] {
            let metrics = Arc::new(Metrics::new());
            let mut svc = Limits::new(1 << 20, 4, Duration::from_secs(1), Arc::clone(&metrics))
                .layer(answering(Duration::ZERO, Some(answer.clone())));
            let response = svc.call(call(method, &[])).await.unwrap();
            assert_eq!(status(&response).message(), answer.message());
            assert_eq!(code(&response), tonic::Code::ResourceExhausted);
            let text = metrics.encode();
            assert_eq!(
                text.contains(&format!(
                    "grpc_rejected_total{{method=\"{method}\",reason=\"decoded-size\"}} 1"
                )),
                counted,
                "{method} {answer:?}: {text}"
            );
        }
    }

    #[tokio::test]
    async fn a_slow_call_is_answered_deadline_exceeded_in_time() {
        let inner = routes(Duration::from_secs(30));
        let mut svc = limits(4, Duration::from_millis(200)).layer(inner);
        let started = Instant::now();
        let response = svc.call(call("NodeGroupIncreaseSize", &[])).await.unwrap();
        assert_eq!(code(&response), tonic::Code::DeadlineExceeded);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(200), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[tokio::test]
    async fn calls_over_the_concurrency_limit_wait_then_are_unavailable() {
        let inner = routes(Duration::ZERO);
        let limits = limits(1, Duration::from_millis(300));
        let mut svc = limits.layer(inner.clone());
        let held = limits.0.permits.acquire().await.unwrap();
        let started = Instant::now();
        let response = svc.call(call("NodeGroups", &[])).await.unwrap();
        assert_eq!(code(&response), tonic::Code::Unavailable);
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(inner.called.load(Ordering::SeqCst), 0);

        // A waiting call gets the permit as soon as it is given back.
        let waiting = tokio::spawn(svc.call(call("NodeGroups", &[])));
        let deadline = Instant::now() + Duration::from_secs(5);
        while limits.0.deadlines.waiting() == 0 {
            assert!(
                Instant::now() < deadline,
                "the call never waited for the permit"
            );
            tokio::task::yield_now().await;
        }
        drop(held);
        let response = waiting.await.unwrap().unwrap();
        assert_eq!(code(&response), tonic::Code::Ok);
        assert_eq!(inner.called.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn health_and_reflection_are_not_limited() {
        let inner = routes(Duration::from_millis(400));
        let mut svc = limits(1, Duration::from_millis(100)).layer(inner);
        let request = http::Request::post("/grpc.health.v1.Health/Check")
            .body(Body::empty())
            .unwrap();
        let response = svc.call(request).await.unwrap();
        assert_eq!(code(&response), tonic::Code::Ok);
    }
}
