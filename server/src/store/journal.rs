//! The per-disk index journal, `index.log`.
//!
//! Data extents carry only page records; where each record lives is kept here,
//! in an append-only log of CRC-framed entries: PUT (offset, extent length,
//! the 64-byte page header, the key) after a record's data is on media, DEL
//! when a record is evicted or deleted (always before its space is reused).
//! Recovery replays the log and stops at the first entry that does not
//! validate (a torn tail), so it reads one sequential file and never the data.
//! The log is rewritten from the live index (oldest first, so replay restores
//! recency) at start, at clean shutdown and whenever it grows to twice the
//! live set; the rewrite goes to a temp file that is renamed into place.

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kv_common::page::HEADER_LEN;

pub const JOURNAL_FILE: &str = "index.log";
const MAGIC: u32 = 0x4A43_564B; // "KVCJ"
const VERSION: u32 = 1;
const FILE_HEADER_LEN: u64 = 16;
const KIND_PUT: u8 = 1;
const KIND_DEL: u8 = 2;
/// Largest entry payload: kind, offset, length, header, longest key.
const MAX_ENTRY: usize = 1 + 8 + 8 + HEADER_LEN + kv_common::page::MAX_KEY_LEN;

/// A replayed entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replayed {
    Put { off: u64, alloc_len: u64, header: [u8; HEADER_LEN], key: Vec<u8> },
    Del { key: Vec<u8> },
}

/// An entry to append.
#[derive(Debug, Clone, Copy)]
pub enum Entry<'a> {
    Put { off: u64, alloc_len: u64, header: &'a [u8; HEADER_LEN], key: &'a [u8] },
    Del { key: &'a [u8] },
}

fn encode(e: &Entry<'_>, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    match e {
        Entry::Put { off, alloc_len, header, key } => {
            out.push(KIND_PUT);
            out.extend_from_slice(&off.to_le_bytes());
            out.extend_from_slice(&alloc_len.to_le_bytes());
            out.extend_from_slice(&header[..]);
            out.extend_from_slice(key);
        }
        Entry::Del { key } => {
            out.push(KIND_DEL);
            out.extend_from_slice(key);
        }
    }
    let body_len = (out.len() - start - 8) as u32;
    let crc = crc32fast::hash(&out[start + 8..]);
    out[start..start + 4].copy_from_slice(&body_len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

fn decode(body: &[u8]) -> Option<Replayed> {
    let (&kind, rest) = body.split_first()?;
    match kind {
        KIND_PUT if rest.len() > 16 + HEADER_LEN => {
            let off = u64::from_le_bytes(rest[0..8].try_into().ok()?);
            let alloc_len = u64::from_le_bytes(rest[8..16].try_into().ok()?);
            let mut header = [0u8; HEADER_LEN];
            header.copy_from_slice(&rest[16..16 + HEADER_LEN]);
            Some(Replayed::Put { off, alloc_len, header, key: rest[16 + HEADER_LEN..].to_vec() })
        }
        KIND_DEL if !rest.is_empty() => Some(Replayed::Del { key: rest.to_vec() }),
        _ => None,
    }
}

/// Result of reading a journal.
pub struct Replay {
    pub entries: Vec<Replayed>,
    /// Bytes after the last valid entry (a torn tail), dropped.
    pub torn_bytes: u64,
    /// Length of the valid prefix of the file.
    pub valid_len: u64,
}

/// An open journal, appended to at its tail.
pub struct Journal {
    path: PathBuf,
    file: Arc<File>,
    tail: u64,
    entries: u64,
    scratch: Vec<u8>,
    /// While a rewrite is under way: a copy of every entry appended since its
    /// snapshot, added to the new file before it replaces this one.
    since_snapshot: Option<(Vec<u8>, u64)>,
}

/// A rewritten journal in its temp file, not yet in place.
pub struct Snapshot {
    tmp: PathBuf,
    file: File,
    len: u64,
    entries: u64,
}

impl Snapshot {
    /// Appends already-encoded entries (carried over from the live journal).
    pub fn append_raw(&mut self, bytes: &[u8], n: u64) -> io::Result<()> {
        self.file.write_all_at(bytes, self.len)?;
        self.len += bytes.len() as u64;
        self.entries += n;
        Ok(())
    }

    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Removes the temp file.
    pub fn discard(self) {
        let _ = std::fs::remove_file(&self.tmp);
    }
}

impl Journal {
    /// Reads `dir/index.log` (missing: empty). Does not modify it.
    pub fn replay(dir: &Path) -> io::Result<Replay> {
        let path = dir.join(JOURNAL_FILE);
        let mut data = Vec::new();
        match File::open(&path) {
            Ok(mut f) => {
                f.read_to_end(&mut data)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Replay { entries: Vec::new(), torn_bytes: 0, valid_len: 0 })
            }
            Err(e) => return Err(e),
        }
        if data.len() < FILE_HEADER_LEN as usize {
            return Ok(Replay { entries: Vec::new(), torn_bytes: data.len() as u64, valid_len: 0 });
        }
        let magic = u32::from_le_bytes(data[0..4].try_into().expect("4 bytes"));
        let version = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes"));
        if magic != MAGIC || version != VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a kvcellar v{VERSION} index journal", path.display()),
            ));
        }
        let mut entries = Vec::new();
        let mut at = FILE_HEADER_LEN as usize;
        while data.len() - at >= 8 {
            let len = u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(data[at + 4..at + 8].try_into().expect("4 bytes"));
            if len == 0 || len > MAX_ENTRY || data.len() - at - 8 < len {
                break;
            }
            let body = &data[at + 8..at + 8 + len];
            if crc32fast::hash(body) != crc {
                break;
            }
            match decode(body) {
                Some(e) => entries.push(e),
                None => break,
            }
            at += 8 + len;
        }
        Ok(Replay { entries, torn_bytes: (data.len() - at) as u64, valid_len: at as u64 })
    }

    /// Writes `live` (oldest first) to `dir/index.log.tmp` and syncs it. Needs
    /// no lock. On error the temp file is removed.
    pub fn write_snapshot<'a, I>(dir: &Path, live: I) -> io::Result<Snapshot>
    where
        I: IntoIterator<Item = Entry<'a>>,
    {
        let tmp = dir.join(format!("{JOURNAL_FILE}.tmp"));
        let r = (|| {
            let f = File::create(&tmp)?;
            let mut w = BufWriter::with_capacity(1 << 20, f);
            let mut head = [0u8; FILE_HEADER_LEN as usize];
            head[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            head[4..8].copy_from_slice(&VERSION.to_le_bytes());
            w.write_all(&head)?;
            let mut len = FILE_HEADER_LEN;
            let mut entries = 0;
            let mut buf = Vec::with_capacity(MAX_ENTRY + 8);
            for e in live {
                buf.clear();
                encode(&e, &mut buf);
                w.write_all(&buf)?;
                len += buf.len() as u64;
                entries += 1;
            }
            let file = w.into_inner().map_err(|e| e.into_error())?;
            file.sync_data()?;
            Ok((file, len, entries))
        })();
        match r {
            Ok((file, len, entries)) => Ok(Snapshot { tmp, file, len, entries }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Reopens an existing journal for appending after its first `valid_len`
    /// bytes (holding `entries` entries); a torn tail beyond them is cut.
    pub fn reopen(dir: &Path, valid_len: u64, entries: u64) -> io::Result<Journal> {
        let path = dir.join(JOURNAL_FILE);
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
        if file.metadata()?.len() != valid_len {
            file.set_len(valid_len)?;
            file.sync_all()?;
        }
        Ok(Journal {
            path,
            file: Arc::new(file),
            tail: valid_len,
            entries,
            scratch: Vec::with_capacity(MAX_ENTRY + 8),
            since_snapshot: None,
        })
    }

    /// A fresh journal holding `live`, in place (used at open).
    pub fn rewrite<'a, I>(dir: &Path, live: I) -> io::Result<Journal>
    where
        I: IntoIterator<Item = Entry<'a>>,
    {
        let snap = Journal::write_snapshot(dir, live)?;
        let path = dir.join(JOURNAL_FILE);
        if let Err(e) = std::fs::rename(&snap.tmp, &path) {
            snap.discard();
            return Err(e);
        }
        sync_dir(dir)?;
        Ok(Journal {
            path,
            file: Arc::new(snap.file),
            tail: snap.len,
            entries: snap.entries,
            scratch: Vec::with_capacity(MAX_ENTRY + 8),
            since_snapshot: None,
        })
    }

    /// Marks the point a snapshot is taken at: entries appended from now on
    /// are also kept, to be carried into the snapshot before it is installed.
    pub fn begin_snapshot(&mut self) {
        self.since_snapshot = Some((Vec::new(), 0));
    }

    /// Takes the entries kept since the snapshot (or the last drain).
    pub fn drain_since_snapshot(&mut self) -> (Vec<u8>, u64) {
        match &mut self.since_snapshot {
            Some((bytes, n)) => (std::mem::take(bytes), std::mem::take(n)),
            None => (Vec::new(), 0),
        }
    }

    /// Stops keeping entries for a snapshot that will not be installed.
    pub fn abort_snapshot(&mut self) {
        self.since_snapshot = None;
    }

    /// Carries the last kept entries into `snap` and renames it over the
    /// journal, which it then appends to. Only buffered writes and a rename
    /// happen here (under the caller's lock); the caller syncs the returned
    /// file and the directory afterwards. On error the old journal, which
    /// received every entry, stays in use and the temp file is removed.
    pub fn install(&mut self, mut snap: Snapshot) -> io::Result<Arc<File>> {
        let (extra, n) = self.drain_since_snapshot();
        self.since_snapshot = None;
        let r = snap.append_raw(&extra, n).and_then(|()| std::fs::rename(&snap.tmp, &self.path));
        if let Err(e) = r {
            snap.discard();
            return Err(e);
        }
        self.file = Arc::new(snap.file);
        self.tail = snap.len;
        self.entries = snap.entries;
        Ok(self.file.clone())
    }

    /// Appends one entry (buffered: survives a process crash at once, the
    /// device after the next sync of [`Journal::file`]).
    pub fn append(&mut self, e: Entry<'_>) -> io::Result<()> {
        self.append_many([e])
    }

    /// Appends several entries with one write (as [`Journal::append`] of
    /// each in turn).
    pub fn append_many<'e>(&mut self, entries: impl IntoIterator<Item = Entry<'e>>) -> io::Result<()> {
        self.scratch.clear();
        let mut n = 0;
        for e in entries {
            encode(&e, &mut self.scratch);
            n += 1;
        }
        self.file.write_all_at(&self.scratch, self.tail)?;
        self.tail += self.scratch.len() as u64;
        self.entries += n;
        if let Some((copy, kept)) = &mut self.since_snapshot {
            copy.extend_from_slice(&self.scratch);
            *kept += n;
        }
        Ok(())
    }

    /// The open file, for an `fdatasync` taken outside the journal's lock.
    pub fn file(&self) -> Arc<File> {
        self.file.clone()
    }

    /// Entries in the file (live and superseded).
    pub fn entries(&self) -> u64 {
        self.entries
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// fsyncs a directory so a rename or create in it is durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::fs::OpenOptions;

    #[test]
    fn snapshot_keeps_entries_appended_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let h = [3u8; HEADER_LEN];
        let mut j =
            Journal::rewrite(dir.path(), [Entry::Put { off: 0, alloc_len: 4096, header: &h, key: b"a" }]).unwrap();
        j.begin_snapshot();
        let snap = Journal::write_snapshot(dir.path(), [Entry::Put { off: 0, alloc_len: 4096, header: &h, key: b"a" }])
            .unwrap();
        // Appended while the snapshot was being written: must survive install.
        j.append(Entry::Put { off: 4096, alloc_len: 4096, header: &h, key: b"b" }).unwrap();
        j.append(Entry::Del { key: b"a" }).unwrap();
        j.install(snap).unwrap();
        j.append(Entry::Put { off: 8192, alloc_len: 4096, header: &h, key: b"c" }).unwrap();
        let r = Journal::replay(dir.path()).unwrap();
        let keys: Vec<_> = r
            .entries
            .iter()
            .map(|e| match e {
                Replayed::Put { key, .. } => format!("put {}", String::from_utf8_lossy(key)),
                Replayed::Del { key } => format!("del {}", String::from_utf8_lossy(key)),
            })
            .collect();
        assert_eq!(keys, ["put a", "put b", "del a", "put c"]);
        assert_eq!(j.entries(), 4);
        assert!(!dir.path().join("index.log.tmp").exists());
    }

    #[test]
    fn append_replay_and_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let h = [7u8; HEADER_LEN];
        let mut j =
            Journal::rewrite(dir.path(), [Entry::Put { off: 0, alloc_len: 4096, header: &h, key: b"a" }]).unwrap();
        j.append(Entry::Put { off: 4096, alloc_len: 8192, header: &h, key: b"b" }).unwrap();
        j.append(Entry::Del { key: b"a" }).unwrap();
        let r = Journal::replay(dir.path()).unwrap();
        assert_eq!(r.torn_bytes, 0);
        assert_eq!(r.entries.len(), 3);
        assert_eq!(r.entries[2], Replayed::Del { key: b"a".to_vec() });
        // Tear the last entry: replay keeps the first two and reports the rest.
        let p = dir.path().join(JOURNAL_FILE);
        let len = std::fs::metadata(&p).unwrap().len();
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len - 2).unwrap();
        let r = Journal::replay(dir.path()).unwrap();
        assert_eq!(r.entries.len(), 2);
        assert!(r.torn_bytes > 0);
        // A flipped byte inside an entry ends replay there too.
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&[0xFF], FILE_HEADER_LEN + 20).unwrap();
        assert_eq!(Journal::replay(dir.path()).unwrap().entries.len(), 0);
    }
}
