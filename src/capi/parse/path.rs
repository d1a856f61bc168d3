//! Typed access by path. A path is a list of object keys from the root; absent and null read as
//! `None`. Errors name the path and describe what was found.
use std::collections::BTreeMap;

use serde_json::Value;

use super::{ParseError, ROOT};

pub(super) fn root(obj: &Value) -> Result<(), ParseError> {
    if obj.is_object() {
        Ok(())
    } else {
        Err(ParseError::wrong_type(ROOT, "an object", obj))
    }
}

pub(super) fn dotted(path: &[&str]) -> String {
    path.join(".")
}

/// Prefixes an error found under a sub-object with the sub-object's path.
pub(super) fn rebase(e: ParseError, base: &[&str]) -> ParseError {
    ParseError::new(format!("{}.{}", dotted(base), e.field), e.message)
}

/// The value at `path`; `Ok(None)` when a segment is absent or null; an error when a segment on the way
/// is not an object.
pub(super) fn lookup<'a>(obj: &'a Value, path: &[&str]) -> Result<Option<&'a Value>, ParseError> {
    let mut current = obj;
    for (i, segment) in path.iter().enumerate() {
        let Value::Object(map) = current else {
            return Err(ParseError::wrong_type(
                dotted(&path[..i]),
                "an object",
                current,
            ));
        };
        match map.get(*segment) {
            None | Some(Value::Null) => return Ok(None),
            Some(v) => current = v,
        }
    }
    Ok(Some(current))
}

pub(super) fn opt_str<'a>(obj: &'a Value, path: &[&str]) -> Result<Option<&'a str>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "a string", other)),
    }
}

/// A string that must be present and non-empty.
pub(super) fn required_str<'a>(obj: &'a Value, path: &[&str]) -> Result<&'a str, ParseError> {
    match opt_str(obj, path)? {
        None => Err(ParseError::missing(dotted(path))),
        Some("") => Err(ParseError::empty(dotted(path))),
        Some(s) => Ok(s),
    }
}

pub(super) fn opt_bool(obj: &Value, path: &[&str]) -> Result<Option<bool>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "a boolean", other)),
    }
}

pub(super) fn opt_i32(obj: &Value, path: &[&str]) -> Result<Option<i32>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_i64() {
            Some(i) => i32::try_from(i)
                .map(Some)
                .map_err(|_| ParseError::wrong_type(dotted(path), "a 32-bit integer", v)),
            None if n.is_u64() => Err(ParseError::wrong_type(dotted(path), "a 32-bit integer", v)),
            None => Err(ParseError::wrong_type(dotted(path), "an integer", v)),
        },
        Some(other) => Err(ParseError::wrong_type(dotted(path), "an integer", other)),
    }
}

pub(super) fn opt_i64(obj: &Value, path: &[&str]) -> Result<Option<i64>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(v @ Value::Number(n)) => n
            .as_i64()
            .map(Some)
            .ok_or_else(|| ParseError::wrong_type(dotted(path), "an integer", v)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "an integer", other)),
    }
}

pub(super) fn opt_array<'a>(
    obj: &'a Value,
    path: &[&str],
) -> Result<Option<&'a Vec<Value>>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(other) => Err(ParseError::wrong_type(dotted(path), "a list", other)),
    }
}

/// A map of strings (labels, annotations); a value that is not a string is an error naming its key.
pub(super) fn string_map(
    obj: &Value,
    path: &[&str],
) -> Result<BTreeMap<String, String>, ParseError> {
    match lookup(obj, path)? {
        None => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(ParseError::wrong_type(
                    format!("{}[{k}]", dotted(path)),
                    "a string",
                    other,
                )),
            })
            .collect(),
        Some(other) => Err(ParseError::wrong_type(
            dotted(path),
            "a map of strings",
            other,
        )),
    }
}

/// A list of strings; an item that is not a string is an error naming its index.
pub(super) fn string_list(obj: &Value, path: &[&str]) -> Result<Vec<String>, ParseError> {
    let Some(items) = opt_array(obj, path)? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(ParseError::wrong_type(
                format!("{}[{i}]", dotted(path)),
                "a string",
                other,
            )),
        })
        .collect()
}

pub(super) fn non_empty(s: Option<&str>) -> Option<String> {
    s.filter(|s| !s.is_empty()).map(str::to_string)
}

/// How a value reads in an error message: strings quoted (and shortened), numbers and booleans as
/// written, containers by their type.
pub(super) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => quote(s),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// A string quoted for a message, cut at 64 characters.
pub(super) fn quote(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}…", &s[..cut]),
    }
}
