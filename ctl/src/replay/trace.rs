//! The request trace `kvctl replay` reads, the pages a request stands for,
//! their keys, and the bytes each page must hold (docs/BENCHMARKS.md,
//! "Trace replay"; the format is described in traces/README.md).

use std::io::BufRead;

use serde::Deserialize;

/// Tokens per block of the trace: each hash id names 512 tokens and
/// everything before them.
pub const BLOCK_TOKENS: u64 = 512;

/// One request of the trace, as kvctl replays it.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Line of the trace file it came from (1-based).
    pub line: usize,
    /// Arrival time in ms from the trace's start.
    pub ts_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// The prompt's chain of 512-token blocks.
    pub hash_ids: Vec<u64>,
}

/// The fields of a trace line kvctl uses (others, such as
/// `output_length`, are ignored).
#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    hash_ids: Vec<u64>,
}

/// Reads requests from a JSONL trace: blank lines are skipped, the first
/// `skip` requests are passed over and at most `limit` are kept. `name`
/// (the file's name) prefixes errors, which name the line.
pub fn parse<R: BufRead>(input: R, name: &str, skip: usize, limit: Option<usize>) -> Result<Vec<Request>, String> {
    let mut out = Vec::new();
    let mut seen = 0usize;
    for (i, line) in input.lines().enumerate() {
        let n = i + 1;
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.map_err(|e| format!("{name}:{n}: cannot read: {e}"))?;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(text).map_err(|e| {
            // serde's message ends with the place within the line.
            let msg = e.to_string();
            let msg = msg.rsplit_once(" at line ").map_or(msg.as_str(), |(m, _)| m).to_string();
            format!("{name}:{n}: malformed trace line: {msg} (column {})", e.column())
        })?;
        if !l.timestamp.is_finite() || l.timestamp < 0.0 || l.timestamp > 1e15 {
            return Err(format!("{name}:{n}: malformed trace line: timestamp {} is not a time in ms", l.timestamp));
        }
        seen += 1;
        if seen <= skip {
            continue;
        }
        out.push(Request { line: n, ts_ms: l.timestamp as u64, input_length: l.input_length, hash_ids: l.hash_ids });
    }
    Ok(out)
}

/// How a 512-token block splits into pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Paging {
    /// Pages per block (K); divides 512.
    pub per_block: u32,
}

impl Paging {
    pub fn new(per_block: u32) -> Result<Paging, String> {
        if per_block == 0 || BLOCK_TOKENS % u64::from(per_block) != 0 {
            return Err(format!("--pages-per-block {per_block}: must divide 512 (1, 2, 4, ..., 512)"));
        }
        Ok(Paging { per_block })
    }

    /// Tokens per page.
    pub fn page_tokens(&self) -> u64 {
        BLOCK_TOKENS / u64::from(self.per_block)
    }

    /// The full pages of a request, in chain order: K for each full block,
    /// floor(tokens / page tokens) for a partial last block (engines store
    /// only full pages). A block with no tokens ends the chain.
    pub fn pages(&self, r: &Request) -> Vec<PageId> {
        let mut out = Vec::new();
        for (b, &h) in r.hash_ids.iter().enumerate() {
            let tokens = r.input_length.saturating_sub(b as u64 * BLOCK_TOKENS).min(BLOCK_TOKENS);
            let n = (tokens / self.page_tokens()) as u32;
            out.extend((0..n).map(|p| PageId { hash: h, page: p }));
            if n < self.per_block {
                break;
            }
        }
        out
    }
}

/// A page: the block id (which names the whole prefix) and the page's
/// index within the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId {
    pub hash: u64,
    pub page: u32,
}

/// The key of a page in a run: `replay/{tag}/{hash_id}/{page_index}`.
pub fn key(tag: &str, p: PageId) -> String {
    format!("replay/{tag}/{}/{}", p.hash, p.page)
}

/// One step of splitmix64: a fast generator whose every output is a
/// well-mixed function of the state.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_4476_D1CE_4E5B);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the payload of `key`: a generator seeded by the key's
/// xxh3, so the bytes follow from the key alone.
pub fn fill_payload(key: &[u8], out: &mut [u8]) {
    let mut s = kv_common::page::key_hash(key);
    for chunk in out.chunks_mut(8) {
        let w = splitmix(&mut s).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Whether `data` is exactly the payload of `key` of `len` bytes.
pub fn payload_matches(key: &[u8], data: &[u8], len: usize) -> bool {
    if data.len() != len {
        return false;
    }
    let mut s = kv_common::page::key_hash(key);
    data.chunks(8).all(|chunk| splitmix(&mut s).to_le_bytes()[..chunk.len()] == *chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input_length: u64, hash_ids: &[u64]) -> Request {
        Request { line: 1, ts_ms: 0, input_length, hash_ids: hash_ids.to_vec() }
    }

    #[test]
    fn parses_lines_skips_blanks_and_names_a_bad_line() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
                    {\"timestamp\": 1500, \"input_length\": 100, \"hash_ids\": [7]}\n";
        let r = parse(text.as_bytes(), "t.jsonl", 0, None).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], Request { line: 1, ts_ms: 0, input_length: 600, hash_ids: vec![0, 1] });
        assert_eq!(r[1], Request { line: 3, ts_ms: 1500, input_length: 100, hash_ids: vec![7] });
        // --skip and --limit count requests, not lines.
        let r = parse(text.as_bytes(), "t.jsonl", 1, Some(1)).unwrap();
        assert_eq!(r.iter().map(|r| r.line).collect::<Vec<_>>(), vec![3]);
        let r = parse(text.as_bytes(), "t.jsonl", 0, Some(1)).unwrap();
        assert_eq!(r.len(), 1);

        let bad = "{\"timestamp\": 0, \"input_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 0, \"hash_ids\": [1]}\n";
        let e = parse(bad.as_bytes(), "t.jsonl", 0, None).unwrap_err();
        assert!(e.starts_with("t.jsonl:2: malformed trace line") && e.contains("input_length"), "{e}");
        let e = parse("not json\n".as_bytes(), "t.jsonl", 0, None).unwrap_err();
        assert!(e.starts_with("t.jsonl:1: "), "{e}");
        let e =
            parse("{\"timestamp\": -4, \"input_length\": 1, \"hash_ids\": []}".as_bytes(), "x", 0, None).unwrap_err();
        assert!(e.contains("x:1: ") && e.contains("timestamp"), "{e}");
        let e =
            parse("{\"timestamp\": 0, \"input_length\": 1, \"hash_ids\": [-1]}".as_bytes(), "x", 0, None).unwrap_err();
        assert!(e.contains("x:1: "), "{e}");
    }

    #[test]
    fn pages_are_full_only_and_a_partial_block_gives_its_full_pages() {
        let one = Paging::new(1).unwrap();
        assert_eq!(one.page_tokens(), 512);
        // 1000 tokens: block 0 full, block 1 holds 488 tokens (no full page).
        assert_eq!(one.pages(&req(1000, &[10, 11])), vec![PageId { hash: 10, page: 0 }]);
        assert_eq!(one.pages(&req(1024, &[10, 11])).len(), 2);
        assert!(one.pages(&req(300, &[10])).is_empty());
        let four = Paging::new(4).unwrap();
        assert_eq!(four.page_tokens(), 128);
        // 4 pages of block 10, then floor(488 / 128) = 3 of block 11.
        let p = four.pages(&req(1000, &[10, 11]));
        let want: Vec<PageId> =
            (0..4).map(|i| PageId { hash: 10, page: i }).chain((0..3).map(|i| PageId { hash: 11, page: i })).collect();
        assert_eq!(p, want);
        // More ids than tokens: the chain ends with the tokens.
        assert_eq!(four.pages(&req(600, &[1, 2, 3])).len(), 4);
        assert!(Paging::new(0).is_err());
        assert!(Paging::new(3).is_err());
        assert!(Paging::new(1024).is_err());
        assert_eq!(Paging::new(512).unwrap().page_tokens(), 1);
    }

    #[test]
    fn a_payload_follows_from_its_key() {
        let k = key("t1", PageId { hash: 42, page: 3 });
        assert_eq!(k, "replay/t1/42/3");
        for len in [0, 1, 7, 8, 13, 4096] {
            let mut a = vec![0u8; len];
            let mut b = vec![1u8; len];
            fill_payload(k.as_bytes(), &mut a);
            fill_payload(k.as_bytes(), &mut b);
            assert_eq!(a, b);
            assert!(payload_matches(k.as_bytes(), &a, len));
            if len > 0 {
                let mut c = a.clone();
                c[len - 1] ^= 1;
                assert!(!payload_matches(k.as_bytes(), &c, len), "a flipped byte is caught");
                assert!(!payload_matches(k.as_bytes(), &a[..len - 1], len), "a short page is caught");
            }
        }
        let mut a = vec![0u8; 64];
        let mut b = vec![0u8; 64];
        fill_payload(b"replay/t1/42/3", &mut a);
        fill_payload(b"replay/t1/42/4", &mut b);
        assert_ne!(a, b, "another key, other bytes");
        assert!(!payload_matches(b"replay/t1/42/4", &a, 64));
    }
}
