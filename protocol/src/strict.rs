//! Decoding exactly as strict as SPEC §2 says.
//!
//! `rmp_serde` on its own is lenient: it reads a struct from a positional array as well as
//! from a map, an enum from its variant index as well as from its name, and a string from
//! a `bin`. SPEC §2 allows none of these (structs are maps with string keys, enumerations
//! are strings, strings are `str`), and positional encodings silently misread fields once
//! a field is optional. [`from_slice`] decodes through [`Strict`], a deserializer adapter
//! that refuses them at every depth:
//!
//! - a struct (any `deserialize_struct`) must be a map;
//! - a string, a map key naming a field, and an enum's variant must be a msgpack `str`
//!   (not `bin`, not an integer);
//! - a byte string (`serde_bytes` fields: handles, GIDs) must be a msgpack `bin`, not a
//!   `str`;
//! - everything else decodes as before, with nested values decoded strictly too.
//!
//! The adapter wraps the deserializer, every visitor it hands out, and every access object
//! (`SeqAccess`, `MapAccess`, `EnumAccess`, `VariantAccess`) those visitors receive, so
//! the rules hold inside arrays, maps, options and newtypes.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, Visitor};

/// Decodes `T` from msgpack under the SPEC's rules (see the module docs).
pub fn from_slice<'de, T: de::Deserialize<'de>>(
    b: &'de [u8],
) -> Result<T, rmp_serde::decode::Error> {
    let mut d = rmp_serde::Deserializer::from_read_ref(b);
    T::deserialize(Strict(&mut d))
}

/// See the module docs.
pub struct Strict<D>(pub D);

/// What a wrapped visitor accepts beyond its own rules.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// No extra rule.
    Any,
    /// A struct: a map only.
    Map,
    /// A string or identifier: `str` only.
    Text,
    /// A byte string: `bin` only.
    Bin,
}

struct V<Vi> {
    inner: Vi,
    rule: Rule,
}

fn v<Vi>(inner: Vi, rule: Rule) -> V<Vi> {
    V { inner, rule }
}

macro_rules! forward {
    ($($method:ident)*) => {$(
        fn $method<Vi: Visitor<'de>>(self, visitor: Vi) -> Result<Vi::Value, Self::Error> {
            self.0.$method(v(visitor, Rule::Any))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Strict<D> {
    type Error = D::Error;

    forward! {
        deserialize_any deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32
        deserialize_i64 deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32
        deserialize_u64 deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char
        deserialize_option deserialize_unit
        deserialize_seq deserialize_map deserialize_ignored_any
    }

    fn deserialize_str<Vi: Visitor<'de>>(self, visitor: Vi) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_str(v(visitor, Rule::Text))
    }

    fn deserialize_bytes<Vi: Visitor<'de>>(self, visitor: Vi) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_bytes(v(visitor, Rule::Bin))
    }

    fn deserialize_byte_buf<Vi: Visitor<'de>>(self, visitor: Vi) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_byte_buf(v(visitor, Rule::Bin))
    }

    fn deserialize_string<Vi: Visitor<'de>>(self, visitor: Vi) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_string(v(visitor, Rule::Text))
    }

    fn deserialize_identifier<Vi: Visitor<'de>>(self, visitor: Vi) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_identifier(v(visitor, Rule::Text))
    }

    fn deserialize_unit_struct<Vi: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: Vi,
    ) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_unit_struct(name, v(visitor, Rule::Any))
    }

    fn deserialize_newtype_struct<Vi: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: Vi,
    ) -> Result<Vi::Value, D::Error> {
        self.0
            .deserialize_newtype_struct(name, v(visitor, Rule::Any))
    }

    fn deserialize_tuple<Vi: Visitor<'de>>(
        self,
        len: usize,
        visitor: Vi,
    ) -> Result<Vi::Value, D::Error> {
        self.0.deserialize_tuple(len, v(visitor, Rule::Any))
    }

    fn deserialize_tuple_struct<Vi: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: Vi,
    ) -> Result<Vi::Value, D::Error> {
        self.0
            .deserialize_tuple_struct(name, len, v(visitor, Rule::Any))
    }

    fn deserialize_struct<Vi: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: Vi,
    ) -> Result<Vi::Value, D::Error> {
        self.0
            .deserialize_struct(name, fields, v(visitor, Rule::Map))
    }

    fn deserialize_enum<Vi: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: Vi,
    ) -> Result<Vi::Value, D::Error> {
        self.0
            .deserialize_enum(name, variants, v(visitor, Rule::Any))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

impl<Vi> V<Vi> {
    fn refuse<E: de::Error>(&self, got: de::Unexpected<'_>, exp: &dyn de::Expected) -> E {
        E::invalid_type(got, exp)
    }
}

struct Expect<'a, Vi>(&'a Vi, &'static str);

impl<'de, Vi: Visitor<'de>> de::Expected for Expect<'_, Vi> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)?;
        write!(f, " ({})", self.1)
    }
}

macro_rules! number {
    ($($method:ident: $t:ty => $unexp:ident as $as:ty,)*) => {$(
        fn $method<E: de::Error>(self, x: $t) -> Result<Self::Value, E> {
            if self.rule == Rule::Text {
                return Err(self.refuse(
                    de::Unexpected::$unexp(x as $as),
                    &Expect(&self.inner, "a msgpack str: SPEC §2"),
                ));
            }
            self.inner.$method(x)
        }
    )*};
}

impl<'de, Vi: Visitor<'de>> Visitor<'de> for V<Vi> {
    type Value = Vi::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    number! {
        visit_i8: i8 => Signed as i64,
        visit_i16: i16 => Signed as i64,
        visit_i32: i32 => Signed as i64,
        visit_i64: i64 => Signed as i64,
        visit_u8: u8 => Unsigned as u64,
        visit_u16: u16 => Unsigned as u64,
        visit_u32: u32 => Unsigned as u64,
        visit_u64: u64 => Unsigned as u64,
        visit_f32: f32 => Float as f64,
        visit_f64: f64 => Float as f64,
    }

    fn visit_bool<E: de::Error>(self, x: bool) -> Result<Self::Value, E> {
        if self.rule == Rule::Text {
            return Err(self.refuse(
                de::Unexpected::Bool(x),
                &Expect(&self.inner, "a msgpack str: SPEC §2"),
            ));
        }
        self.inner.visit_bool(x)
    }

    fn visit_i128<E: de::Error>(self, x: i128) -> Result<Self::Value, E> {
        if self.rule == Rule::Text {
            return Err(E::custom("an integer where SPEC §2 wants a msgpack str"));
        }
        self.inner.visit_i128(x)
    }

    fn visit_u128<E: de::Error>(self, x: u128) -> Result<Self::Value, E> {
        if self.rule == Rule::Text {
            return Err(E::custom("an integer where SPEC §2 wants a msgpack str"));
        }
        self.inner.visit_u128(x)
    }

    fn visit_char<E: de::Error>(self, x: char) -> Result<Self::Value, E> {
        self.inner.visit_char(x)
    }

    fn visit_str<E: de::Error>(self, x: &str) -> Result<Self::Value, E> {
        if self.rule == Rule::Bin {
            return Err(E::custom("a msgpack str where SPEC §2 wants bin"));
        }
        self.inner.visit_str(x)
    }

    fn visit_borrowed_str<E: de::Error>(self, x: &'de str) -> Result<Self::Value, E> {
        if self.rule == Rule::Bin {
            return Err(E::custom("a msgpack str where SPEC §2 wants bin"));
        }
        self.inner.visit_borrowed_str(x)
    }

    fn visit_string<E: de::Error>(self, x: String) -> Result<Self::Value, E> {
        if self.rule == Rule::Bin {
            return Err(E::custom("a msgpack str where SPEC §2 wants bin"));
        }
        self.inner.visit_string(x)
    }

    fn visit_bytes<E: de::Error>(self, x: &[u8]) -> Result<Self::Value, E> {
        if self.rule == Rule::Text {
            return Err(self.refuse(
                de::Unexpected::Bytes(x),
                &Expect(&self.inner, "a msgpack str, not bin: SPEC §2"),
            ));
        }
        self.inner.visit_bytes(x)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, x: &'de [u8]) -> Result<Self::Value, E> {
        if self.rule == Rule::Text {
            return Err(self.refuse(
                de::Unexpected::Bytes(x),
                &Expect(&self.inner, "a msgpack str, not bin: SPEC §2"),
            ));
        }
        self.inner.visit_borrowed_bytes(x)
    }

    fn visit_byte_buf<E: de::Error>(self, x: Vec<u8>) -> Result<Self::Value, E> {
        if self.rule == Rule::Text {
            return Err(self.refuse(
                de::Unexpected::Bytes(&x),
                &Expect(&self.inner, "a msgpack str, not bin: SPEC §2"),
            ));
        }
        self.inner.visit_byte_buf(x)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
        self.inner.visit_some(Strict(d))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_newtype_struct<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
        self.inner.visit_newtype_struct(Strict(d))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        if self.rule != Rule::Any {
            return Err(self.refuse(
                de::Unexpected::Seq,
                &Expect(
                    &self.inner,
                    "a map with named fields, not a positional array: SPEC §2",
                ),
            ));
        }
        self.inner.visit_seq(Strict(seq))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        if self.rule == Rule::Text {
            return Err(self.refuse(
                de::Unexpected::Map,
                &Expect(&self.inner, "a msgpack str: SPEC §2"),
            ));
        }
        self.inner.visit_map(Strict(map))
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        self.inner.visit_enum(Strict(data))
    }
}

/// A seed whose deserializer is wrapped.
struct Seed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<S> {
    type Value = S::Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Strict(d))
    }
}

impl<'de, A: de::SeqAccess<'de>> de::SeqAccess<'de> for Strict<A> {
    type Error = A::Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(Seed(seed))
    }
    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: de::MapAccess<'de>> de::MapAccess<'de> for Strict<A> {
    type Error = A::Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.0.next_key_seed(Seed(seed))
    }
    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.0.next_value_seed(Seed(seed))
    }
    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: de::EnumAccess<'de>> de::EnumAccess<'de> for Strict<A> {
    type Error = A::Error;
    type Variant = Strict<A::Variant>;
    fn variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<(T::Value, Self::Variant), A::Error> {
        self.0
            .variant_seed(Seed(seed))
            .map(|(val, var)| (val, Strict(var)))
    }
}

impl<'de, A: de::VariantAccess<'de>> de::VariantAccess<'de> for Strict<A> {
    type Error = A::Error;
    fn unit_variant(self) -> Result<(), A::Error> {
        self.0.unit_variant()
    }
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.0.newtype_variant_seed(Seed(seed))
    }
    fn tuple_variant<Vi: Visitor<'de>>(
        self,
        len: usize,
        visitor: Vi,
    ) -> Result<Vi::Value, A::Error> {
        self.0.tuple_variant(len, v(visitor, Rule::Any))
    }
    fn struct_variant<Vi: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: Vi,
    ) -> Result<Vi::Value, A::Error> {
        self.0.struct_variant(fields, v(visitor, Rule::Map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;
    use serde::Serialize;

    fn named<T: Serialize>(t: &T) -> Vec<u8> {
        rmp_serde::to_vec_named(t).unwrap()
    }

    fn layout() -> Layout {
        Layout {
            model: "m".into(),
            num_layers: 2,
            kv_parts: 2,
            num_kv_heads: 1,
            head_dim: 32,
            dtype: Dtype::F16,
            tokens_per_block: 16,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::LayerPartTokenHead,
            groups: Vec::new(),
        }
    }

    #[test]
    fn named_maps_decode() {
        let l = layout();
        assert_eq!(from_slice::<Layout>(&named(&l)).unwrap(), l);
        let r = AllocReq {
            client: ClientId(1),
            layout_id: LayoutId(2),
            keys: vec![ChunkHash([7; 16])],
        };
        assert_eq!(from_slice::<AllocReq>(&named(&r)).unwrap(), r);
        let opt: Option<Layout> = from_slice(&named(&Some(l.clone()))).unwrap();
        assert_eq!(opt, Some(l));
    }

    /// The lenient decodings rmp_serde accepts on its own: each is refused here, and the
    /// negative control shows plain rmp_serde takes it (so the test tests the adapter).
    #[test]
    fn byte_strings_must_be_bin() {
        use crate::gpu::GpuRegion;
        #[derive(serde::Serialize)]
        struct AsStr<'a> {
            handle: &'a str,
            size: u64,
        }
        let r = GpuRegion {
            handle: b"abc".to_vec(),
            size: 3,
        };
        assert_eq!(from_slice::<GpuRegion>(&named(&r)).unwrap(), r);
        let s = rmp_serde::to_vec_named(&AsStr {
            handle: "abc",
            size: 3,
        })
        .unwrap();
        let e = from_slice::<GpuRegion>(&s).unwrap_err().to_string();
        assert!(e.contains("wants bin"), "{e}");
    }

    #[test]
    fn positional_structs_integer_enums_and_bin_strings_are_refused() {
        let l = layout();
        let positional = rmp_serde::to_vec(&l).unwrap();
        assert!(
            rmp_serde::from_slice::<Layout>(&positional).is_ok(),
            "control"
        );
        assert!(from_slice::<Layout>(&positional).is_err());
        // nested: a positional layout inside a named request body
        let mut m = Vec::new();
        rmp::encode::write_map_len(&mut m, 1).unwrap();
        rmp::encode::write_str(&mut m, "layout").unwrap();
        m.extend_from_slice(&positional);
        assert!(
            rmp_serde::from_slice::<RegisterLayoutReq>(&m).is_ok(),
            "control"
        );
        assert!(from_slice::<RegisterLayoutReq>(&m).is_err());
        // an enum by its variant index
        let mut d = Vec::new();
        rmp::encode::write_uint(&mut d, 2).unwrap();
        assert!(rmp_serde::from_slice::<Dtype>(&d).is_ok(), "control");
        assert!(from_slice::<Dtype>(&d).is_err());
        // a string as bin
        let mut b = Vec::new();
        rmp::encode::write_bin(&mut b, b"hello").unwrap();
        assert!(rmp_serde::from_slice::<String>(&b).is_ok(), "control");
        assert!(from_slice::<String>(&b).is_err());
        // a field name as an integer key
        let mut k = Vec::new();
        rmp::encode::write_map_len(&mut k, 1).unwrap();
        rmp::encode::write_uint(&mut k, 0).unwrap();
        rmp::encode::write_uint(&mut k, 5).unwrap();
        assert!(from_slice::<StatsReq>(&k).is_err());
        // keys stay bin, ints stay ints
        let keys = named(&vec![ChunkHash([1; 16])]);
        assert!(from_slice::<Vec<ChunkHash>>(&keys).is_ok());
        assert_eq!(from_slice::<u64>(&named(&7u64)).unwrap(), 7);
    }
}
