//! KV events (SPEC §14): what a daemon publishes when blocks enter or leave its tiers,
//! in the format vLLM engines publish (`vllm.distributed.kv_events`), so that consumers
//! written for vLLM (routers' prefix indexes) read kvd's events unchanged.
//!
//! A message on the PUB socket has three frames: the topic, the sequence number (8 bytes,
//! big-endian; one counter per daemon incarnation, starting at 0), and the payload, a
//! msgpack *array* `[ts, events, nil]` (vLLM's `KVEventBatch`, `array_like`; the third
//! element, the data-parallel rank, nil). Each event is a msgpack *map* tagged by `"type"`:
//!
//! | `type` | fields kvd sets |
//! |---|---|
//! | `BlockStored` | `block_hashes` (16-byte bins: kvd chunk hashes), `parent_block_hash` nil, `token_ids` `[]`, `block_size` (the layout's tokens per block), `lora_id` nil, `medium` (`"CPU"`: the DRAM pool; `"STORAGE"`: the NVMe tier), `lora_name` nil |
//! | `BlockRemoved` | `block_hashes`, `medium` |
//! | `AllBlocksCleared` | none |
//!
//! The topic names the layout: `<prefix>.<layout id, 16 hex digits>` (`prefix` from the
//! config, `kvd` by default), so a router subscribes to the layouts of the model it
//! routes; an `AllBlocksCleared` goes out on `<prefix>.all`.
//!
//! This module encodes and decodes payloads; it does no I/O.

use serde::{Deserialize, Serialize};

use crate::{ChunkHash, LayoutId};

/// Where a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The node's shared DRAM pool (vLLM's `"CPU"`).
    Dram,
    /// The node's NVMe tier (vLLM's `"STORAGE"`).
    Nvme,
}

impl Medium {
    /// vLLM's name of the medium.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Dram => "CPU",
            Medium::Nvme => "STORAGE",
        }
    }

    /// The medium of a vLLM name (`None`: another one, e.g. `"GPU"`).
    pub fn from_name(name: &str) -> Option<Medium> {
        match name {
            "CPU" => Some(Medium::Dram),
            "STORAGE" => Some(Medium::Nvme),
            _ => None,
        }
    }
}

/// One event as the daemon records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks of a layout became readable on a medium.
    Stored {
        /// The layout.
        layout: LayoutId,
        /// Its tokens per block.
        block_size: u64,
        /// The blocks.
        hashes: Vec<ChunkHash>,
        /// Where.
        medium: Medium,
    },
    /// Blocks of a layout left a medium.
    Removed {
        /// The layout.
        layout: LayoutId,
        /// The blocks.
        hashes: Vec<ChunkHash>,
        /// Where from.
        medium: Medium,
    },
    /// Everything this publisher said before is void (a daemon started, or resent its
    /// whole cache after losing events).
    AllCleared,
}

/// A chunk hash as a msgpack bin (vLLM's `ExternalBlockHash` is `bytes | int`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hash(ChunkHash);

impl Serialize for Hash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0 .0)
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let b: serde_bytes::ByteBuf = Deserialize::deserialize(d)?;
        let a: [u8; 16] = b.as_slice().try_into().map_err(|_| {
            serde::de::Error::custom(format!("a block hash of {} bytes, not 16", b.len()))
        })?;
        Ok(Hash(ChunkHash(a)))
    }
}

/// The wire form of one event (a map tagged by `type`, fields in vLLM's order).
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "type")]
enum Wire {
    BlockStored {
        block_hashes: Vec<Hash>,
        parent_block_hash: Option<Hash>,
        token_ids: Vec<u32>,
        block_size: u64,
        lora_id: Option<u64>,
        medium: Option<String>,
        lora_name: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<Hash>,
        medium: Option<String>,
    },
    AllBlocksCleared {},
}

/// A decoded batch: its timestamp (seconds since the epoch) and events (a layout is
/// known from the topic, not the payload: decoded events carry `LayoutId(0)` and
/// `block_size` as sent).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// When it was published.
    pub ts: f64,
    /// Its events.
    pub events: Vec<KvEvent>,
}

/// A PUB message's frames (`[topic, seq, payload]`), checked: `None` for any other shape.
pub fn parse_pub(frames: Vec<Vec<u8>>) -> Option<(Vec<u8>, u64, Vec<u8>)> {
    let [topic, seq, payload]: [Vec<u8>; 3] = frames.try_into().ok()?;
    let seq = u64::from_be_bytes(seq.as_slice().try_into().ok()?);
    Some((topic, seq, payload))
}

/// What a replay endpoint sent a DEALER (`["", topic, seq, payload]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Replayed {
    /// A kept batch: topic, sequence number, payload.
    Batch(Vec<u8>, u64, Vec<u8>),
    /// The end marker (sequence number -1).
    End,
}

/// A replay answer's frames, checked: `None` for any other shape.
pub fn parse_replay(frames: Vec<Vec<u8>>) -> Option<Replayed> {
    let [_, topic, seq, payload]: [Vec<u8>; 4] = frames.try_into().ok()?;
    let seq = i64::from_be_bytes(seq.as_slice().try_into().ok()?);
    Some(if seq < 0 {
        Replayed::End
    } else {
        Replayed::Batch(topic, seq as u64, payload)
    })
}

/// The topic of a layout's events.
pub fn topic(prefix: &str, layout: Option<LayoutId>) -> String {
    match layout {
        Some(l) => format!("{prefix}.{:016x}", l.0),
        None => format!("{prefix}.all"),
    }
}

/// The layout a topic names (`None`: the `.all` topic or another publisher's).
pub fn topic_layout(prefix: &str, topic: &[u8]) -> Option<LayoutId> {
    let t = std::str::from_utf8(topic).ok()?;
    let hex = t.strip_prefix(prefix)?.strip_prefix('.')?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok().map(LayoutId)
}

fn to_wire(e: &KvEvent) -> Wire {
    match e {
        KvEvent::Stored {
            block_size,
            hashes,
            medium,
            ..
        } => Wire::BlockStored {
            block_hashes: hashes.iter().copied().map(Hash).collect(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: *block_size,
            lora_id: None,
            medium: Some(medium.name().to_string()),
            lora_name: None,
        },
        KvEvent::Removed { hashes, medium, .. } => Wire::BlockRemoved {
            block_hashes: hashes.iter().copied().map(Hash).collect(),
            medium: Some(medium.name().to_string()),
        },
        KvEvent::AllCleared => Wire::AllBlocksCleared {},
    }
}

/// Encodes a batch payload: `[ts, [event, ...], nil]`.
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let wire: Vec<Wire> = events.iter().map(to_wire).collect();
    // Maps with field names (msgspec's tagged structs); the batch's third element, the
    // data-parallel rank, is nil as vLLM writes it (decoders that read the batch as a
    // fixed 3-tuple find it). Infallible for these types.
    rmp_serde::to_vec_named(&(ts, wire, None::<i64>)).unwrap_or_default()
}

/// Why an event message could not be decoded or applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// The payload is not a batch (msgpack `[ts, [event, ...], rank?]` of known events).
    #[error("undecodable batch: {0}")]
    Undecodable(String),
    /// A message for a worker the index does not follow.
    #[error("no worker {0}")]
    NoWorker(usize),
}

/// Decodes a batch payload (a peer's or kvd's; unknown media are skipped, an unknown
/// event type is an error).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, EventError> {
    #[derive(Deserialize)]
    #[allow(dead_code)] // the rank is read to accept it, not used
    struct B(f64, Vec<Wire>, #[serde(default)] Option<i64>);
    let B(ts, wire, _) =
        rmp_serde::from_slice(payload).map_err(|e| EventError::Undecodable(e.to_string()))?;
    let mut events = Vec::with_capacity(wire.len());
    for w in wire {
        match w {
            Wire::BlockStored {
                block_hashes,
                block_size,
                medium,
                ..
            } => {
                if let Some(medium) = medium.as_deref().and_then(Medium::from_name) {
                    events.push(KvEvent::Stored {
                        layout: LayoutId(0),
                        block_size,
                        hashes: block_hashes.into_iter().map(|h| h.0).collect(),
                        medium,
                    });
                }
            }
            Wire::BlockRemoved {
                block_hashes,
                medium,
            } => {
                if let Some(medium) = medium.as_deref().and_then(Medium::from_name) {
                    events.push(KvEvent::Removed {
                        layout: LayoutId(0),
                        hashes: block_hashes.into_iter().map(|h| h.0).collect(),
                        medium,
                    });
                }
            }
            Wire::AllBlocksCleared {} => events.push(KvEvent::AllCleared),
        }
    }
    Ok(Batch { ts, events })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §14's test vector.
    #[test]
    fn the_spec_vector_encodes_and_decodes() {
        let events = vec![
            KvEvent::Stored {
                layout: LayoutId(7),
                block_size: 16,
                hashes: vec![ChunkHash([0x11; 16])],
                medium: Medium::Dram,
            },
            KvEvent::Removed {
                layout: LayoutId(7),
                hashes: vec![ChunkHash([0x11; 16])],
                medium: Medium::Nvme,
            },
            KvEvent::AllCleared,
        ];
        let p = encode_batch(1.5, &events);
        let want = concat!(
            "93cb3ff8000000000000",
            "93",
            "88a474797065ab426c6f636b53746f726564",
            "ac626c6f636b5f686173686573",
            "91c410",
            "11111111111111111111111111111111",
            "b1706172656e745f626c6f636b5f68617368c0",
            "a9746f6b656e5f69647390",
            "aa626c6f636b5f73697a6510",
            "a76c6f72615f6964c0",
            "a66d656469756da3435055",
            "a96c6f72615f6e616d65c0",
            "83a474797065ac426c6f636b52656d6f766564",
            "ac626c6f636b5f686173686573",
            "91c410",
            "11111111111111111111111111111111",
            "a66d656469756da753544f52414745",
            "81a474797065b0416c6c426c6f636b73436c6561726564",
            "c0",
        );
        assert_eq!(hex::encode(&p), want);
        let b = decode_batch(&p).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(
            b.events,
            vec![
                KvEvent::Stored {
                    layout: LayoutId(0),
                    block_size: 16,
                    hashes: vec![ChunkHash([0x11; 16])],
                    medium: Medium::Dram,
                },
                KvEvent::Removed {
                    layout: LayoutId(0),
                    hashes: vec![ChunkHash([0x11; 16])],
                    medium: Medium::Nvme,
                },
                KvEvent::AllCleared,
            ]
        );
    }

    #[test]
    fn topics_name_the_layout() {
        let t = topic("kvd", Some(LayoutId(0xabc)));
        assert_eq!(t, "kvd.0000000000000abc");
        assert_eq!(topic_layout("kvd", t.as_bytes()), Some(LayoutId(0xabc)));
        assert_eq!(topic_layout("kvd", b"kvd.all"), None);
        assert_eq!(topic_layout("kvd", b"other.0000000000000abc"), None);
        assert_eq!(topic("kvd", None), "kvd.all");
    }

    #[test]
    fn hostile_payloads_are_errors() {
        for p in [
            &b""[..],
            b"\x92",
            b"\x92\xcb",
            &[
                0x92, 0, 0x91, 0x81, 0xa4, b't', b'y', b'p', b'e', 0xa1, b'X',
            ],
        ] {
            assert!(decode_batch(p).is_err(), "{p:?}");
        }
        // A hash of the wrong length.
        let bad = rmp_serde::to_vec_named(&(
            0.0,
            vec![Wire::BlockRemoved {
                block_hashes: vec![],
                medium: None,
            }],
        ))
        .unwrap();
        assert!(decode_batch(&bad).is_ok());
    }
}
