//! The externalgrpc wire types and service, generated from proto/externalgrpc.proto by build.rs, but
//! for [`NodeGroupsResponse`], written here so that the service can answer it from bytes encoded
//! once per snapshot.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("clusterautoscaler.cloudprovider.v1.externalgrpc");

/// The encoded `FileDescriptorSet` of proto/externalgrpc.proto and its imports, served by gRPC
/// reflection so that grpcurl and similar tools work without the .proto file.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("externalgrpc_descriptor");

/// `NodeGroupsResponse { repeated NodeGroup nodeGroups = 1; }`: decoded into `node_groups` (a client),
/// or sent as the bytes [`NodeGroupsResponse::encoded`] made of them (the service: a fleet's groups
/// change only when its snapshot does, and CA asks for them every loop).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeGroupsResponse {
    pub node_groups: Vec<NodeGroup>,
    /// The encoding of the groups, sent as it is; `node_groups` is then empty.
    encoded: Option<prost::bytes::Bytes>,
}

impl NodeGroupsResponse {
    const NODE_GROUPS: u32 = 1;

    /// A response whose groups are encoded now, once: clones of it share the bytes.
    pub fn encoded(node_groups: &[NodeGroup]) -> Self {
        let mut buf = Vec::with_capacity(prost::encoding::message::encoded_len_repeated(
            Self::NODE_GROUPS,
            node_groups,
        ));
        for group in node_groups {
            prost::encoding::message::encode(Self::NODE_GROUPS, group, &mut buf);
        }
        NodeGroupsResponse {
            node_groups: Vec::new(),
            encoded: Some(buf.into()),
        }
    }
}

impl From<Vec<NodeGroup>> for NodeGroupsResponse {
    /// A response encoded when it is sent, as any other message.
    fn from(node_groups: Vec<NodeGroup>) -> Self {
        NodeGroupsResponse {
            node_groups,
            encoded: None,
        }
    }
}

impl prost::Message for NodeGroupsResponse {
    fn encode_raw(&self, buf: &mut impl prost::bytes::BufMut) {
        match &self.encoded {
            Some(bytes) => buf.put_slice(bytes),
            None => {
                for group in &self.node_groups {
                    prost::encoding::message::encode(Self::NODE_GROUPS, group, buf);
                }
            }
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl prost::bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        if tag == Self::NODE_GROUPS {
            prost::encoding::message::merge_repeated(wire_type, &mut self.node_groups, buf, ctx)
        } else {
            prost::encoding::skip_field(wire_type, tag, buf, ctx)
        }
    }

    fn encoded_len(&self) -> usize {
        match &self.encoded {
            Some(bytes) => bytes.len(),
            None => {
                prost::encoding::message::encoded_len_repeated(Self::NODE_GROUPS, &self.node_groups)
            }
        }
    }

    fn clear(&mut self) {
        self.node_groups.clear();
        self.encoded = None;
    }
}
