//! What the service accepts and sends back at most: a hostile or broken client gets a bounded answer
//! and cannot make the provider decode more than a real object could be.

use tonic::Status;

use super::wire::{self, Shape};

/// Longest status message sent back: a hostile id or node name is not echoed whole.
pub(super) const MAX_STATUS_MESSAGE: usize = 1024;

/// Largest `pod_bytes` decoded: the API server refuses objects over 3 MiB, so no real pod is larger.
pub(super) const MAX_POD_BYTES: usize = 3 << 20;

/// Memory a pod may decode into (see [`wire`]): thousands of containers, not millions.
pub(super) const POD_DECODE_BUDGET: u64 = 64 << 20;

/// `text` cut to at most `max` bytes (at a character boundary), saying how long it was.
pub(super) fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    format!("{}… ({} bytes)", crate::problem::cut(text, max), text.len())
}

/// `status` with its message cut to [`MAX_STATUS_MESSAGE`].
pub(super) fn bounded(status: Status) -> Status {
    if status.message().len() > MAX_STATUS_MESSAGE {
        Status::new(status.code(), shorten(status.message(), MAX_STATUS_MESSAGE))
    } else {
        status
    }
}

/// Refuses `pod_bytes` larger than any Kubernetes object, or that would decode into more than
/// [`POD_DECODE_BUDGET`], before decoding them.
pub(super) fn pod_bytes_within_limits(bytes: &[u8]) -> Result<(), Status> {
    if bytes.len() > MAX_POD_BYTES {
        return Err(Status::resource_exhausted(format!(
            "pod_bytes: {} bytes, more than any Kubernetes object can be ({MAX_POD_BYTES})",
            bytes.len()
        )));
    }
    wire::cost(bytes, Shape::Pod, POD_DECODE_BUDGET).map_err(|e| {
        Status::resource_exhausted(format!(
            "pod_bytes: too many containers, volumes or other elements: {e}"
        ))
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::wire::tests::pod_with_containers;
    use tonic::Code;

    #[test]
    fn a_long_status_message_is_cut_keeps_its_code_and_says_how_long_it_was() {
        // Two bytes a character: the cut falls inside one unless it keeps to character boundaries.
        let long = "é".repeat(MAX_STATUS_MESSAGE);
        let status = bounded(Status::not_found(long.clone()));
        assert_eq!(status.code(), Code::NotFound);
        let (kept, note) = status.message().split_once('…').unwrap();
        assert!(kept.len() <= MAX_STATUS_MESSAGE, "{}", kept.len());
        assert_eq!(note, format!(" ({} bytes)", long.len()));

        let short = bounded(Status::invalid_argument("node is required"));
        assert_eq!(short.code(), Code::InvalidArgument);
        assert_eq!(short.message(), "node is required");
    }

    #[test]
    fn pod_bytes_larger_than_any_kubernetes_object_are_refused() {
        let status = pod_bytes_within_limits(&vec![0; MAX_POD_BYTES + 1]).unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status
                .message()
                .starts_with(&format!("pod_bytes: {} bytes,", MAX_POD_BYTES + 1)),
            "{}",
            status.message()
        );
    }

    #[test]
    fn pod_bytes_that_would_decode_into_too_much_memory_are_refused() {
        // 100,000 empty containers: a few hundred KB on the wire, far more than the budget decoded.
        let bytes = pod_with_containers(100_000);
        assert!(bytes.len() <= MAX_POD_BYTES);
        let status = pod_bytes_within_limits(&bytes).unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status
                .message()
                .starts_with("pod_bytes: too many containers, volumes or other elements: "),
            "{}",
            status.message()
        );
        assert!(pod_bytes_within_limits(&pod_with_containers(10)).is_ok());
    }
}
