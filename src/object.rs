//! The objects the provider reads from the API, as JSON without the parts it never reads.
//!
//! kube's `DynamicObject` decodes an object twice over (its flattened fields go through serde's
//! buffered content, then into a typed `ObjectMeta` with every `managedFields` entry) and the index
//! then turns that metadata back into JSON: at 100,000 Machines most of the CPU of a start. An
//! [`ApiObject`] is decoded once, straight into the JSON the parsers read, and never builds what
//! no parser reads: `metadata.managedFields` (often the largest part of an object) and, for Nodes,
//! `status` (their images, conditions and addresses: most of a Node).

use std::borrow::Cow;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::api::ApiResource;
use kube::core::DynamicResourceScope;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// An object of the API: its JSON (`metadata.managedFields` left out, and `status` too unless
/// `STATUS`), and the identity watches and the index key on.
#[derive(Clone, Debug)]
pub struct ApiObject<const STATUS: bool = true> {
    /// Name, namespace, uid and resourceVersion only.
    meta: ObjectMeta,
    json: Value,
}

/// A workload-cluster Node: nothing of its status is read.
pub type NodeObject = ApiObject<false>;

impl<const STATUS: bool> ApiObject<STATUS> {
    /// An object from its JSON (what the API would have sent): tests build objects this way.
    #[cfg(test)]
    pub fn from_json(json: Value) -> Result<Self, serde_json::Error> {
        serde_json::from_value(json)
    }

    pub fn json(&self) -> &Value {
        &self.json
    }

    pub fn into_json(self) -> Value {
        self.json
    }

    fn new(json: Map<String, Value>) -> Self {
        let field = |name: &str| {
            json.get("metadata")
                .and_then(|m| m.get(name))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let meta = ObjectMeta {
            name: field("name"),
            namespace: field("namespace"),
            uid: field("uid"),
            resource_version: field("resourceVersion"),
            ..ObjectMeta::default()
        };
        ApiObject {
            meta,
            json: Value::Object(json),
        }
    }
}

impl<const STATUS: bool> Resource for ApiObject<STATUS> {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn group(dt: &ApiResource) -> Cow<'_, str> {
        dt.group.as_str().into()
    }

    fn version(dt: &ApiResource) -> Cow<'_, str> {
        dt.version.as_str().into()
    }

    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }

    fn api_version(dt: &ApiResource) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }

    fn plural(dt: &ApiResource) -> Cow<'_, str> {
        dt.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

impl<'de, const STATUS: bool> Deserialize<'de> for ApiObject<STATUS> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_map(TopLevel::<STATUS>)
            .map(ApiObject::new)
    }
}

struct TopLevel<const STATUS: bool>;

impl<'de, const STATUS: bool> Visitor<'de> for TopLevel<STATUS> {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "metadata" => {
                    let metadata = map.next_value_seed(Metadata)?;
                    out.insert(key, metadata);
                }
                "status" if !STATUS => {
                    map.next_value::<IgnoredAny>()?;
                }
                _ => {
                    let value = map.next_value::<Value>()?;
                    out.insert(key, value);
                }
            }
        }
        Ok(out)
    }
}

/// `metadata` as it is, but for `managedFields`; anything that is not an object is kept as it is
/// (for the parsers to name what is wrong).
struct Metadata;

impl<'de> DeserializeSeed<'de> for Metadata {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Metadata {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("object metadata")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "managedFields" {
                map.next_value::<IgnoredAny>()?;
            } else {
                let value = map.next_value::<Value>()?;
                out.insert(key, value);
            }
        }
        Ok(Value::Object(out))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(value) = seq.next_element::<Value>()? {
            out.push(value);
        }
        Ok(Value::Array(out))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    fn machine() -> Value {
        json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "Machine",
            "metadata": {
                "name": "m-1",
                "namespace": "ns",
                "uid": "u-1",
                "resourceVersion": "42",
                "labels": {"a": "b"},
                "managedFields": [{"manager": "capi", "fieldsV1": {"f:spec": {"f:replicas": {}}}}],
            },
            "spec": {"clusterName": "c"},
            "status": {"nodeRef": {"name": "n-1"}},
        })
    }

    #[test]
    fn an_object_keeps_everything_but_its_managed_fields() {
        let wire = serde_json::to_string(&machine()).unwrap_or_default();
        let obj: ApiObject = serde_json::from_str(&wire).expect("decodes");
        let mut want = machine();
        if let Some(metadata) = want.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.remove("managedFields");
        }
        assert_eq!(obj.json(), &want);
        assert_eq!(obj.name_any(), "m-1");
        assert_eq!(obj.namespace().as_deref(), Some("ns"));
        assert_eq!(obj.uid().as_deref(), Some("u-1"));
        assert_eq!(obj.resource_version().as_deref(), Some("42"));
    }

    #[test]
    fn a_node_leaves_its_status_out() {
        let node = json!({
            "metadata": {"name": "n-1", "resourceVersion": "7"},
            "spec": {"providerID": "p://1"},
            "status": {"images": [{"names": ["a"], "sizeBytes": 1}], "capacity": {"cpu": "2"}},
        });
        let obj = NodeObject::from_json(node).expect("decodes");
        assert_eq!(
            obj.json(),
            &json!({"metadata": {"name": "n-1", "resourceVersion": "7"}, "spec": {"providerID": "p://1"}})
        );
    }

    #[test]
    fn metadata_that_is_not_an_object_is_kept_for_the_parsers_to_name() {
        for metadata in [
            json!("x"),
            json!(null),
            json!([1, "a"]),
            json!(3),
            json!(true),
        ] {
            let obj = ApiObject::<true>::from_json(json!({"metadata": metadata.clone()}))
                .expect("decodes");
            assert_eq!(obj.json(), &json!({ "metadata": metadata }));
            assert_eq!(obj.resource_version(), None);
        }
    }

    #[test]
    fn what_is_not_an_object_is_an_error() {
        assert!(ApiObject::<true>::from_json(json!([1])).is_err());
        assert!(serde_json::from_str::<ApiObject>("{\"metadata\": {").is_err());
    }
}
