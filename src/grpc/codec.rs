//! The codec of the CloudProvider service (build.rs names it for every method): prost's, but a
//! request that carries nodes is measured before it is decoded. Its few bytes could decode into far
//! more memory than they take (an empty node is two bytes on the wire and a few hundred decoded),
//! so one whose decoded form would pass [`NODE_REQUEST_BUDGET`] is refused `RESOURCE_EXHAUSTED`
//! without decoding it. The gRPC library hands the decoder the whole message, so nothing is read
//! or copied for the check.

use std::marker::PhantomData;

use prost::Message;
use prost::bytes::Buf;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::wire::{self, Shape};
use crate::proto::*;

/// Memory a request that carries nodes (their labels and annotations) may decode into.
pub const NODE_REQUEST_BUDGET: u64 = 64 << 20;

/// The start of the status message of a request refused for its decoded size: how the limits layer
/// tells the refusal from an answer (see `crate::server`).
pub const TOO_LARGE_DECODED: &str = "too many nodes, labels or annotations";

/// Whether the requests of `method` carry `ExternalGrpcNode`s, whose maps and (for DeleteNodes)
/// whose list cost hundreds of bytes per two bytes on the wire. PricingPodPrice carries its pod as
/// bytes, checked by the handler.
pub fn carries_nodes(method: &str) -> bool {
    matches!(
        method,
        "NodeGroupDeleteNodes" | "NodeGroupForNode" | "PricingNodePrice"
    )
}

/// A message the codec decodes: the method whose requests it is, when they carry nodes.
pub trait Screened {
    /// `Some(method)` for the requests measured before they are decoded.
    const CARRIES_NODES_OF: Option<&'static str> = None;
}

macro_rules! carries_no_nodes {
    ($($message:ty),* $(,)?) => { $(impl Screened for $message {})* };
}

carries_no_nodes!(
    NodeGroupsRequest,
    NodeGroupsResponse,
    NodeGroupForNodeResponse,
    PricingNodePriceResponse,
    PricingPodPriceRequest,
    PricingPodPriceResponse,
    GpuLabelRequest,
    GpuLabelResponse,
    GetAvailableGpuTypesRequest,
    GetAvailableGpuTypesResponse,
    CleanupRequest,
    CleanupResponse,
    RefreshRequest,
    RefreshResponse,
    NodeGroupTargetSizeRequest,
    NodeGroupTargetSizeResponse,
    NodeGroupIncreaseSizeRequest,
    NodeGroupIncreaseSizeResponse,
    NodeGroupDeleteNodesResponse,
    NodeGroupDecreaseTargetSizeRequest,
    NodeGroupDecreaseTargetSizeResponse,
    NodeGroupNodesRequest,
    NodeGroupNodesResponse,
    NodeGroupTemplateNodeInfoRequest,
    NodeGroupTemplateNodeInfoResponse,
    NodeGroupAutoscalingOptionsRequest,
    NodeGroupAutoscalingOptionsResponse,
);

impl Screened for NodeGroupForNodeRequest {
    const CARRIES_NODES_OF: Option<&'static str> = Some("NodeGroupForNode");
}

impl Screened for NodeGroupDeleteNodesRequest {
    const CARRIES_NODES_OF: Option<&'static str> = Some("NodeGroupDeleteNodes");
}

impl Screened for PricingNodePriceRequest {
    const CARRIES_NODES_OF: Option<&'static str> = Some("PricingNodePrice");
}

/// prost's codec, with [`ScreenedDecoder`] for decoding.
pub struct ScreenedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ScreenedCodec<T, U> {
    fn default() -> Self {
        ScreenedCodec(PhantomData)
    }
}

impl<T, U> Codec for ScreenedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Screened + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ScreenedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ScreenedDecoder(ProstDecoder::default())
    }
}

/// prost's decoder, after [`screen`] for the requests that carry nodes.
pub struct ScreenedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + Screened> Decoder for ScreenedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let Some(method) = U::CARRIES_NODES_OF else {
            return self.0.decode(buf);
        };
        // The library gathers a message into one buffer; were it ever in pieces, they are joined.
        if buf.chunk().len() == buf.remaining() {
            screen(method, buf.chunk())?;
            return self.0.decode(buf);
        }
        let whole = buf.copy_to_bytes(buf.remaining());
        screen(method, &whole)?;
        U::decode(whole)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Refuses `message` (a request of `method`) when its decoded form would pass
/// [`NODE_REQUEST_BUDGET`].
fn screen(method: &str, message: &[u8]) -> Result<(), Status> {
    wire::cost(message, Shape::NodeRequest, NODE_REQUEST_BUDGET)
        .map(drop)
        .map_err(|e| Status::resource_exhausted(format!("{method}: {TOO_LARGE_DECODED}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;
    use tonic::codec::Streaming;

    /// `message` framed as one gRPC message.
    fn framed(message: &[u8]) -> tonic::body::Body {
        let mut bytes = vec![0u8];
        bytes.extend((message.len() as u32).to_be_bytes());
        bytes.extend_from_slice(message);
        tonic::body::Body::new(http_body_util::Full::new(prost::bytes::Bytes::from(bytes)))
    }

    async fn decode<U>(message: &[u8]) -> Result<Option<U>, Status>
    where
        U: Message + Default + Screened + Send + 'static,
    {
        let decoder = ScreenedCodec::<(), U>::default().decoder();
        Streaming::new_request(decoder, framed(message), None, Some(16 << 20))
            .message()
            .await
    }

    #[tokio::test]
    async fn a_request_with_millions_of_empty_nodes_is_refused_before_it_is_decoded() {
        // 500,000 empty nodes: 1 MB on the wire, far more decoded.
        let nodes: Vec<u8> = std::iter::repeat_n([0x0a, 0x00], 500_000)
            .flatten()
            .collect();
        let status = decode::<NodeGroupDeleteNodesRequest>(&nodes)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status
                .message()
                .starts_with(&format!("NodeGroupDeleteNodes: {TOO_LARGE_DECODED}: ")),
            "{}",
            status.message()
        );
        // The same bytes as a request that carries no nodes are decoded (into unknown fields).
        assert!(decode::<NodeGroupTargetSizeRequest>(&nodes).await.is_ok());
    }

    #[tokio::test]
    async fn a_request_of_a_few_nodes_is_decoded_as_prost_decodes_it() {
        let request = NodeGroupForNodeRequest {
            node: Some(ExternalGrpcNode {
                provider_id: "e2e:///ns/a".into(),
                name: "a".into(),
                labels: [("zone".to_string(), "a".to_string())].into(),
                ..Default::default()
            }),
        };
        let decoded = decode::<NodeGroupForNodeRequest>(&request.encode_to_vec())
            .await
            .unwrap();
        assert_eq!(decoded, Some(request));
        // A malformed one fails as prost's decoder fails.
        let status = decode::<NodeGroupForNodeRequest>(&[0x0a, 0x05, 0x01])
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Internal);
    }

    #[test]
    fn the_requests_measured_are_those_of_the_methods_that_carry_nodes() {
        let measured = [
            NodeGroupForNodeRequest::CARRIES_NODES_OF,
            NodeGroupDeleteNodesRequest::CARRIES_NODES_OF,
            PricingNodePriceRequest::CARRIES_NODES_OF,
        ];
        for method in crate::proto::METHODS {
            assert_eq!(
                carries_nodes(method),
                measured.contains(&Some(method)),
                "{method}"
            );
        }
        assert_eq!(NodeGroupTargetSizeRequest::CARRIES_NODES_OF, None);
        assert_eq!(PricingPodPriceRequest::CARRIES_NODES_OF, None);
    }
}
