//! YAML documents as JSON texts, a `List`'s items one at a time: a document is read as its
//! fields but `items` (a tree, then JSON text, as before) and each of its items as a tree
//! of its own, turned into JSON text at once, so a List of tens of thousands of objects is
//! never one tree (a 10,000 x 10 List as one YAML tree and its JSON copy was 490 MiB).

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One YAML document: the JSON text of its fields but `items`, and each item's.
pub(super) struct Doc {
    pub head: String,
    pub items: Vec<String>,
}

/// Every document of `text`; `Ok(None)` for one that is not a mapping (empty, `null`, a
/// scalar, a sequence: no object). `Err` names the document (1-based) and the cause.
pub(super) fn documents(text: &str) -> impl Iterator<Item = Result<Option<Doc>, String>> + '_ {
    serde_yaml::Deserializer::from_str(text)
        .enumerate()
        .map(|(i, doc)| {
            DocSeed
                .deserialize(doc)
                .map_err(|e| format!("document {}: {e}", i + 1))
        })
}

/// A YAML value as JSON text (through the YAML tree, as the whole document was before:
/// the same conversion of keys and scalars).
fn json<E: de::Error>(v: &serde_yaml::Value) -> Result<String, E> {
    serde_json::to_string(v).map_err(E::custom)
}

struct DocSeed;

impl<'de> DeserializeSeed<'de> for DocSeed {
    type Value = Option<Doc>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(DocVisitor)
    }
}

/// Anything but a mapping is no object.
macro_rules! nothing {
    ($($f:ident: $t:ty),*) => {$(
        fn $f<E: de::Error>(self, _: $t) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
    )*};
}

struct DocVisitor;

impl<'de> Visitor<'de> for DocVisitor {
    type Value = Option<Doc>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a YAML document")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut head = serde_yaml::Mapping::new();
        let mut items = Vec::new();
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            if key.as_str() == Some("items") {
                items = map.next_value::<Items>()?.0;
            } else {
                let value = map.next_value::<serde_yaml::Value>()?;
                if head.insert(key.clone(), value).is_some() {
                    return Err(de::Error::custom(format!(
                        "duplicate entry with key {key:?}"
                    )));
                }
            }
        }
        Ok(Some(Doc {
            head: json(&serde_yaml::Value::Mapping(head))?,
            items,
        }))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    nothing!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64, visit_str: &str);
}

/// A document's `items`: each element's JSON text if it is a sequence, else none (as the
/// tree's lookup read it).
#[derive(Default)]
struct Items(Vec<String>);

impl<'de> de::Deserialize<'de> for Items {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemsVisitor)
    }
}

struct ItemsVisitor;

impl<'de> Visitor<'de> for ItemsVisitor {
    type Value = Items;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Items, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<serde_yaml::Value>()? {
            items.push(json(&item)?);
        }
        Ok(Items(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Items, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Items::default())
    }
    fn visit_unit<E: de::Error>(self) -> Result<Items, E> {
        Ok(Items::default())
    }
    fn visit_none<E: de::Error>(self) -> Result<Items, E> {
        Ok(Items::default())
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Items, D::Error> {
        d.deserialize_any(self)
    }
    nothing!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64, visit_str: &str);
}
