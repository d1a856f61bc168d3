//! The externalgrpc wire types and service, generated from proto/externalgrpc.proto by build.rs, but
//! for [`NodeGroupsResponse`] and [`NodeGroupForNodeResponse`], written here so that the service can
//! answer them from bytes encoded once per group change: both are a list of `NodeGroup` in field 1,
//! of every group or of one, so one encoding of a group ([`node_group_field`]) serves both.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("clusterautoscaler.cloudprovider.v1.externalgrpc");

/// The encoded `FileDescriptorSet` of proto/externalgrpc.proto and its imports, served by gRPC
/// reflection so that grpcurl and similar tools work without the .proto file.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("externalgrpc_descriptor");

/// Every CloudProvider method, as its path names it (bounded label values for the metrics).
pub const METHODS: [&str; 15] = [
    "NodeGroups",
    "NodeGroupForNode",
    "PricingNodePrice",
    "PricingPodPrice",
    "GPULabel",
    "GetAvailableGPUTypes",
    "Cleanup",
    "Refresh",
    "NodeGroupTargetSize",
    "NodeGroupIncreaseSize",
    "NodeGroupDeleteNodes",
    "NodeGroupDecreaseTargetSize",
    "NodeGroupNodes",
    "NodeGroupTemplateNodeInfo",
    "NodeGroupGetOptions",
];

/// The field number of the `NodeGroup` in both hand-written responses.
const NODE_GROUP_FIELD: u32 = 1;

/// `group` as field 1 of a message: one entry of a [`NodeGroupsResponse`], or the whole of a
/// [`NodeGroupForNodeResponse`].
pub fn node_group_field(group: &NodeGroup) -> Vec<u8> {
    let mut buf = Vec::with_capacity(prost::encoding::message::encoded_len(
        NODE_GROUP_FIELD,
        group,
    ));
    prost::encoding::message::encode(NODE_GROUP_FIELD, group, &mut buf);
    buf
}

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
    /// A response of the groups encoded as [`node_group_field`] makes them, in order: clones of it
    /// share the bytes.
    pub fn encoded<'a>(fields: impl IntoIterator<Item = &'a [u8]>) -> Self {
        NodeGroupsResponse {
            node_groups: Vec::new(),
            encoded: Some(fields.into_iter().collect::<Vec<&[u8]>>().concat().into()),
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
                    prost::encoding::message::encode(NODE_GROUP_FIELD, group, buf);
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
        if tag == NODE_GROUP_FIELD {
            prost::encoding::message::merge_repeated(wire_type, &mut self.node_groups, buf, ctx)
        } else {
            prost::encoding::skip_field(wire_type, tag, buf, ctx)
        }
    }

    fn encoded_len(&self) -> usize {
        match &self.encoded {
            Some(bytes) => bytes.len(),
            None => {
                prost::encoding::message::encoded_len_repeated(NODE_GROUP_FIELD, &self.node_groups)
            }
        }
    }

    fn clear(&mut self) {
        self.node_groups.clear();
        self.encoded = None;
    }
}

/// `NodeGroupForNodeResponse { NodeGroup nodeGroup = 1; }`: decoded into `node_group` (a client), or
/// sent as the bytes [`node_group_field`] made of the group (the service: CA asks once per node every
/// loop, and a group changes far less often).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeGroupForNodeResponse {
    pub node_group: Option<NodeGroup>,
    /// The encoding of the group, sent as it is; `node_group` is then `None`.
    encoded: Option<prost::bytes::Bytes>,
}

impl NodeGroupForNodeResponse {
    /// A response of the group encoded as [`node_group_field`] makes it.
    pub fn encoded(field: prost::bytes::Bytes) -> Self {
        NodeGroupForNodeResponse {
            node_group: None,
            encoded: Some(field),
        }
    }
}

impl From<NodeGroup> for NodeGroupForNodeResponse {
    /// A response encoded when it is sent, as any other message.
    fn from(group: NodeGroup) -> Self {
        NodeGroupForNodeResponse {
            node_group: Some(group),
            encoded: None,
        }
    }
}

impl prost::Message for NodeGroupForNodeResponse {
    fn encode_raw(&self, buf: &mut impl prost::bytes::BufMut) {
        match (&self.encoded, &self.node_group) {
            (Some(bytes), _) => buf.put_slice(bytes),
            (None, Some(group)) => prost::encoding::message::encode(NODE_GROUP_FIELD, group, buf),
            (None, None) => {}
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl prost::bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        if tag == NODE_GROUP_FIELD {
            prost::encoding::message::merge(
                wire_type,
                self.node_group.get_or_insert_with(NodeGroup::default),
                buf,
                ctx,
            )
        } else {
            prost::encoding::skip_field(wire_type, tag, buf, ctx)
        }
    }

    fn encoded_len(&self) -> usize {
        match (&self.encoded, &self.node_group) {
            (Some(bytes), _) => bytes.len(),
            (None, Some(group)) => prost::encoding::message::encoded_len(NODE_GROUP_FIELD, group),
            (None, None) => 0,
        }
    }

    fn clear(&mut self) {
        self.node_group = None;
        self.encoded = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn group(id: &str) -> NodeGroup {
        NodeGroup {
            id: id.into(),
            min_size: 1,
            max_size: 5,
            debug: format!("{id} (min: 1, max: 5, replicas: 2)"),
        }
    }

    #[test]
    fn a_group_encoded_once_is_what_either_response_encodes_of_it() {
        let (a, b) = (group("MachineDeployment/ns/a"), group("MachineSet/ns/b"));
        let (field_a, field_b) = (node_group_field(&a), node_group_field(&b));

        let one = NodeGroupForNodeResponse::encoded(field_a.clone().into());
        assert_eq!(
            one.encode_to_vec(),
            NodeGroupForNodeResponse::from(a.clone()).encode_to_vec()
        );
        assert_eq!(one.encoded_len(), field_a.len());
        let read = NodeGroupForNodeResponse::decode(one.encode_to_vec().as_slice()).unwrap();
        assert_eq!(read.node_group, Some(a.clone()));

        let all = NodeGroupsResponse::encoded([field_a.as_slice(), field_b.as_slice()]);
        let plain = NodeGroupsResponse::from(vec![a.clone(), b.clone()]);
        assert_eq!(all.encode_to_vec(), plain.encode_to_vec());
        assert_eq!(all.encoded_len(), plain.encoded_len());
        let read = NodeGroupsResponse::decode(all.encode_to_vec().as_slice()).unwrap();
        assert_eq!(read.node_groups, vec![a, b]);
    }

    #[test]
    fn a_response_with_no_group_encodes_nothing_and_unknown_fields_are_skipped() {
        assert!(
            NodeGroupForNodeResponse::default()
                .encode_to_vec()
                .is_empty()
        );
        // Field 2 (a varint), then the group: a newer server's field does not break the read.
        let mut bytes = vec![0x10, 0x01];
        bytes.extend(node_group_field(&group("MachineDeployment/ns/a")));
        let read = NodeGroupForNodeResponse::decode(bytes.as_slice()).unwrap();
        assert_eq!(read.node_group.unwrap().id, "MachineDeployment/ns/a");
    }
}
