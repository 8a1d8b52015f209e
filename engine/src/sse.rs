//! Reading server-sent events: the router reads the decode leg's stream, tests and the
//! bench read the router's.

use anyhow::{bail, Context, Result};
use futures_util::{Stream, StreamExt};

use crate::api::{CompletionResponse, ErrorBody};

/// One parsed `data:` event.
#[derive(Debug)]
pub enum SseEvent {
    /// A completion chunk.
    Chunk(Box<CompletionResponse>),
    /// An error event.
    Error(ErrorBody),
    /// `data: [DONE]`.
    Done,
}

/// Splits a byte stream into `data:` payloads.
#[derive(Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
}

impl SseSplitter {
    /// Feeds bytes; returns the complete events' `data` payloads.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&ev);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Parses one `data` payload.
pub fn parse(data: &str) -> Result<SseEvent> {
    if data.trim() == "[DONE]" {
        return Ok(SseEvent::Done);
    }
    let v: serde_json::Value =
        serde_json::from_str(data).with_context(|| format!("bad SSE data: {data}"))?;
    if v.get("error").is_some() {
        return Ok(SseEvent::Error(serde_json::from_value(v)?));
    }
    Ok(SseEvent::Chunk(Box::new(serde_json::from_value(v)?)))
}

/// A whole streamed completion, collected.
#[derive(Debug, Default)]
pub struct Collected {
    /// Text.
    pub text: String,
    /// Token ids.
    pub token_ids: Vec<u32>,
    /// The last chunk (usage, kvd info).
    pub last: Option<CompletionResponse>,
    /// Seconds from the start of reading to the first token.
    pub ttft: Option<f64>,
    /// Error event, if the stream ended with one.
    pub error: Option<String>,
    /// Whether `[DONE]` arrived.
    pub done: bool,
}

/// Reads a stream of SSE bytes to its end.
pub async fn collect<S, B, E>(mut body: S, start: std::time::Instant) -> Result<Collected>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    let mut sp = SseSplitter::default();
    let mut c = Collected::default();
    while let Some(piece) = body.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                c.error.get_or_insert_with(|| format!("stream broke: {e}"));
                return Ok(c);
            }
        };
        for data in sp.feed(piece.as_ref()) {
            match parse(&data)? {
                SseEvent::Chunk(ch) => {
                    if let Some(choice) = ch.choices.first() {
                        if !choice.token_ids.is_empty() && c.ttft.is_none() {
                            c.ttft = Some(start.elapsed().as_secs_f64());
                        }
                        c.text.push_str(&choice.text);
                        c.token_ids.extend_from_slice(&choice.token_ids);
                    }
                    c.last = Some(*ch);
                }
                SseEvent::Error(e) => c.error = Some(e.error.message),
                SseEvent::Done => {
                    c.done = true;
                    return Ok(c);
                }
            }
        }
    }
    if !c.done && c.error.is_none() {
        bail!("stream ended without [DONE]");
    }
    Ok(c)
}
