//! The page record of docs/PROTOCOL.md §3: `header (64 B) | key | payload`.
//!
//! The client builds the header on put and checks it on get; a node validates
//! it on put and compares its geometry on exist, but never rewrites it.

use xxhash_rust::xxh3::xxh3_64;

/// Bytes of the fixed page header.
pub const HEADER_LEN: usize = 64;
/// `"KVPG"` read as a little-endian u32.
pub const PAGE_MAGIC: u32 = 0x4750_564B;
/// The only header version this code writes and accepts.
pub const PAGE_VERSION: u16 = 1;
/// Header flag bit 0: an MLA page, replicated across TP ranks.
pub const FLAG_MLA: u16 = 1;
/// Longest key a record may carry.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest payload a header may claim (1 TiB): far above any page, far below
/// where `64 + key_len + payload_len` could overflow.
pub const MAX_PAYLOAD_LEN: u64 = 1 << 40;

/// The caller's model geometry: every field must match on get (§2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Geometry {
    pub model_hash: u64,
    pub page_size: u32,
    pub dtype_tag: u32,
    pub tp_size: u16,
    pub tp_rank: u16,
    pub layer_num: u16,
    pub head_num: u16,
    pub head_dim: u16,
    pub flags: u16,
}

/// Encoded size of a [`Geometry`] on the wire.
pub const GEOMETRY_WIRE_LEN: usize = 32;

impl Geometry {
    /// True when an MLA page: tp_size and tp_rank are not compared.
    pub fn is_mla(&self) -> bool {
        self.flags & FLAG_MLA != 0
    }

    /// Whether a stored header was written with this geometry (§2 rules).
    pub fn matches(&self, h: &PageHeader) -> bool {
        let g = &h.geometry;
        let base = g.model_hash == self.model_hash
            && g.page_size == self.page_size
            && g.dtype_tag == self.dtype_tag
            && g.layer_num == self.layer_num
            && g.head_num == self.head_num
            && g.head_dim == self.head_dim
            && g.flags == self.flags;
        base && (self.is_mla() || (g.tp_size == self.tp_size && g.tp_rank == self.tp_rank))
    }

    /// Wire form (32 bytes): model_hash, page_size, dtype_tag, tp_size, tp_rank,
    /// layer_num, head_num, head_dim, flags, then 4 zero bytes (flags sits last
    /// here, unlike in the page header).
    pub fn encode(&self) -> [u8; GEOMETRY_WIRE_LEN] {
        let mut b = [0u8; GEOMETRY_WIRE_LEN];
        b[0..8].copy_from_slice(&self.model_hash.to_le_bytes());
        b[8..12].copy_from_slice(&self.page_size.to_le_bytes());
        b[12..16].copy_from_slice(&self.dtype_tag.to_le_bytes());
        b[16..18].copy_from_slice(&self.tp_size.to_le_bytes());
        b[18..20].copy_from_slice(&self.tp_rank.to_le_bytes());
        b[20..22].copy_from_slice(&self.layer_num.to_le_bytes());
        b[22..24].copy_from_slice(&self.head_num.to_le_bytes());
        b[24..26].copy_from_slice(&self.head_dim.to_le_bytes());
        b[26..28].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// Inverse of [`Geometry::encode`]; `None` when the slice is short.
    pub fn decode(b: &[u8]) -> Option<Geometry> {
        if b.len() < GEOMETRY_WIRE_LEN {
            return None;
        }
        Some(Geometry {
            model_hash: le_u64(b, 0),
            page_size: le_u32(b, 8),
            dtype_tag: le_u32(b, 12),
            tp_size: le_u16(b, 16),
            tp_rank: le_u16(b, 18),
            layer_num: le_u16(b, 20),
            head_num: le_u16(b, 22),
            head_dim: le_u16(b, 24),
            flags: le_u16(b, 26),
        })
    }
}

/// A decoded page header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    pub geometry: Geometry,
    pub key_len: u16,
    pub payload_crc: u32,
    pub payload_len: u64,
    pub key_hash: u64,
}

/// Why a header (or a record) did not validate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("record shorter than its header")]
    Short,
    #[error("bad page magic")]
    Magic,
    #[error("unsupported page version {0}")]
    Version(u16),
    #[error("header checksum mismatch")]
    HeaderCrc,
    #[error("key length {0} outside 1..=1024")]
    KeyLen(usize),
    #[error("record length disagrees with the header")]
    Length,
    #[error("key does not match the header's key hash")]
    KeyHash,
}

impl PageHeader {
    /// A header for `key` and `payload_crc`/`payload_len` under `geometry`.
    pub fn new(geometry: Geometry, key: &[u8], payload_len: u64, payload_crc: u32) -> PageHeader {
        PageHeader { geometry, key_len: key.len() as u16, payload_crc, payload_len, key_hash: key_hash(key) }
    }

    /// Total record bytes: header, key and payload.
    pub fn record_len(&self) -> u64 {
        HEADER_LEN as u64 + self.key_len as u64 + self.payload_len
    }

    /// The 64 header bytes, header CRC included.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let g = &self.geometry;
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&PAGE_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&PAGE_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&g.flags.to_le_bytes());
        b[8..16].copy_from_slice(&g.model_hash.to_le_bytes());
        b[16..20].copy_from_slice(&g.page_size.to_le_bytes());
        b[20..24].copy_from_slice(&g.dtype_tag.to_le_bytes());
        b[24..26].copy_from_slice(&g.tp_size.to_le_bytes());
        b[26..28].copy_from_slice(&g.tp_rank.to_le_bytes());
        b[28..30].copy_from_slice(&g.layer_num.to_le_bytes());
        b[30..32].copy_from_slice(&g.head_num.to_le_bytes());
        b[32..34].copy_from_slice(&g.head_dim.to_le_bytes());
        b[34..36].copy_from_slice(&self.key_len.to_le_bytes());
        b[36..40].copy_from_slice(&self.payload_crc.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b[48..56].copy_from_slice(&self.key_hash.to_le_bytes());
        let crc = crc32fast::hash(&b[0..56]);
        b[56..60].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks magic, version, header CRC and key length.
    pub fn decode(b: &[u8]) -> Result<PageHeader, HeaderError> {
        if b.len() < HEADER_LEN {
            return Err(HeaderError::Short);
        }
        if le_u32(b, 0) != PAGE_MAGIC {
            return Err(HeaderError::Magic);
        }
        let version = le_u16(b, 4);
        if version != PAGE_VERSION {
            return Err(HeaderError::Version(version));
        }
        if le_u32(b, 56) != crc32fast::hash(&b[0..56]) {
            return Err(HeaderError::HeaderCrc);
        }
        let key_len = le_u16(b, 34);
        if key_len == 0 || key_len as usize > MAX_KEY_LEN {
            return Err(HeaderError::KeyLen(key_len as usize));
        }
        // A payload length whose record length cannot be represented is a lie
        // (and would overflow every length computation after this point).
        if le_u64(b, 40) > MAX_PAYLOAD_LEN {
            return Err(HeaderError::Length);
        }
        Ok(PageHeader {
            geometry: Geometry {
                flags: le_u16(b, 6),
                model_hash: le_u64(b, 8),
                page_size: le_u32(b, 16),
                dtype_tag: le_u32(b, 20),
                tp_size: le_u16(b, 24),
                tp_rank: le_u16(b, 26),
                layer_num: le_u16(b, 28),
                head_num: le_u16(b, 30),
                head_dim: le_u16(b, 32),
            },
            key_len,
            payload_crc: le_u32(b, 36),
            payload_len: le_u64(b, 40),
            key_hash: le_u64(b, 48),
        })
    }

    /// Checks the header against a key: length and xxh3 hash.
    pub fn check_key(&self, key: &[u8]) -> Result<(), HeaderError> {
        if key.len() != self.key_len as usize {
            return Err(HeaderError::KeyLen(key.len()));
        }
        if key_hash(key) != self.key_hash {
            return Err(HeaderError::KeyHash);
        }
        Ok(())
    }
}

/// Validates the header and key of a whole record (not the payload CRC) and
/// returns the header with the key slice.
pub fn parse_record(rec: &[u8]) -> Result<(PageHeader, &[u8]), HeaderError> {
    let h = PageHeader::decode(rec)?;
    if rec.len() as u64 != h.record_len() {
        return Err(HeaderError::Length);
    }
    let key = &rec[HEADER_LEN..HEADER_LEN + h.key_len as usize];
    h.check_key(key)?;
    Ok((h, key))
}

/// xxh3-64 (seed 0) of the key bytes, as the header stores it.
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64(key)
}

/// Builds a complete record in one vector (tests and small tools).
pub fn build_record(geometry: Geometry, key: &[u8], payload: &[u8]) -> Vec<u8> {
    let h = PageHeader::new(geometry, key, payload.len() as u64, crc32fast::hash(payload));
    let mut v = Vec::with_capacity(HEADER_LEN + key.len() + payload.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(key);
    v.extend_from_slice(payload);
    v
}

/// Validates a key: 1..=1024 bytes.
pub fn valid_key(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN
}

pub(crate) fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

pub(crate) fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

pub(crate) fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example of docs/PROTOCOL.md §3.1, computed independently.
    pub(crate) fn reference_geometry() -> Geometry {
        Geometry {
            model_hash: 20817,
            page_size: 64,
            dtype_tag: 1178092852,
            tp_size: 8,
            tp_rank: 0,
            layer_num: 61,
            head_num: 1,
            head_dim: 576,
            flags: 1,
        }
    }

    const REF_RECORD_HEX: &str = "4b5650470100010051510000000000004000000034453846080000003d0001004002060085114a0d0b00000000000000e7b5c2ec4602c83b5f7ecc9700000000706167652d3068656c6c6f20776f726c64";

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn reference_record_bit_for_bit() {
        let rec = build_record(reference_geometry(), b"page-0", b"hello world");
        assert_eq!(hex(&rec), REF_RECORD_HEX);
        assert_eq!(crc32fast::hash(b"hello world"), 222957957);
        assert_eq!(key_hash(b"page-0"), 4307695547223029223);
        let (h, key) = parse_record(&rec).unwrap();
        assert_eq!(key, b"page-0");
        assert_eq!(h.geometry, reference_geometry());
        assert_eq!(h.payload_len, 11);
    }

    #[test]
    fn every_header_byte_is_covered_by_the_crc() {
        let rec = build_record(reference_geometry(), b"page-0", b"hello world");
        for i in 0..60 {
            let mut bad = rec.clone();
            bad[i] ^= 0x40;
            assert!(parse_record(&bad).is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn geometry_rules_follow_mla() {
        let g = reference_geometry();
        let h = PageHeader::new(g, b"k", 1, 0);
        let mut other_rank = g;
        other_rank.tp_rank = 3;
        assert!(other_rank.matches(&h), "MLA ignores tp_rank");
        let mut mha = g;
        mha.flags = 0;
        let hm = PageHeader::new(mha, b"k", 1, 0);
        let mut mha_rank = mha;
        mha_rank.tp_rank = 3;
        assert!(!mha_rank.matches(&hm), "MHA compares tp_rank");
        let mut other_model = g;
        other_model.model_hash += 1;
        assert!(!other_model.matches(&h));
        assert_eq!(Geometry::decode(&g.encode()), Some(g));
    }

    #[test]
    fn an_absurd_payload_length_is_refused_not_overflowed() {
        let mut h = PageHeader::new(reference_geometry(), b"key", 0, 0);
        h.payload_len = u64::MAX - 10;
        assert_eq!(PageHeader::decode(&h.encode()).unwrap_err(), HeaderError::Length);
        h.payload_len = MAX_PAYLOAD_LEN;
        assert!(PageHeader::decode(&h.encode()).is_ok());
    }

    #[test]
    fn key_and_length_checks() {
        let g = reference_geometry();
        let rec = build_record(g, b"abc", b"xyz");
        assert_eq!(parse_record(&rec[..rec.len() - 1]).unwrap_err(), HeaderError::Length);
        let mut wrong_key = rec.clone();
        wrong_key[HEADER_LEN] = b'X';
        assert_eq!(parse_record(&wrong_key).unwrap_err(), HeaderError::KeyHash);
    }
}
