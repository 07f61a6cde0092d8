//! Reading a source's bytes and their content digest (sha256 over the exact bytes).

use super::IngestError;
use crate::config::{SourceConfig, SourceKind};
use sha2::{Digest, Sha256};

/// The bytes of one fetched layer version and what identifies them.
#[derive(Debug, Clone)]
pub struct FetchedLayer {
    pub bytes: Vec<u8>,
    /// Hex sha256 of `bytes`.
    pub digest: String,
}

/// Hex sha256 of a byte slice.
pub fn digest(bytes: &[u8]) -> String {
    crate::util::hex(&Sha256::digest(bytes))
}

/// Hex sha256 and size of a file, read in 1 MiB pieces (a county layer never sits in memory).
pub fn digest_file(path: &std::path::Path) -> Result<(String, u64), IngestError> {
    let read_err = |e| IngestError::Read { path: path.to_path_buf(), source: e };
    let file = std::fs::File::open(path).map_err(read_err)?;
    DigestingReader::new(file).finish().map_err(read_err)
}

/// A reader that hashes every byte passing through it. The streaming diff reads a file
/// layer through one, so the digest its watermark records is that of the very bytes the scan
/// read (a file replaced between a separate digest pass and the scan could not be told
/// apart), and a layer that changed is read once, not twice.
pub struct DigestingReader<R> {
    inner: R,
    hasher: Sha256,
    size: u64,
    /// The first read error, kept for the caller: the scan that met it reports a document
    /// it could not read, while the error itself says why (EIO, a directory, ...).
    error: Option<std::io::Error>,
}

impl<R: std::io::Read> DigestingReader<R> {
    pub fn new(inner: R) -> Self {
        DigestingReader { inner, hasher: Sha256::new(), size: 0, error: None }
    }

    /// The first error a read returned, if any (taken: asked once).
    pub fn take_error(&mut self) -> Option<std::io::Error> {
        self.error.take()
    }

    /// Reads whatever the consumer left unread (trailing bytes after the document) and
    /// returns the hex sha256 and size of everything.
    pub fn finish(mut self) -> std::io::Result<(String, u64)> {
        if let Err(e) = std::io::copy(&mut self, &mut std::io::sink()) {
            // The error itself when it was kept (see `read`), not its text.
            return Err(self.error.take().unwrap_or(e));
        }
        Ok((crate::util::hex(&self.hasher.finalize()), self.size))
    }
}

impl<R: std::io::Read> std::io::Read for DigestingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = match self.inner.read(buf) {
            // A reader claiming more than the buffer holds is cut to the buffer.
            Ok(n) => n.min(buf.len()),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::Interrupted && self.error.is_none() {
                    // The error itself is kept (a stop's refusal is known by its type,
                    // `run_stop::is_stop`); the scan gets its text.
                    let copy = std::io::Error::new(e.kind(), e.to_string());
                    self.error = Some(e);
                    return Err(copy);
                }
                return Err(e);
            }
        };
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }
}

/// A writer that hashes every byte written through it: a paged portal layer is digested as
/// its collection is written out, so the bytes the run scans are not read twice.
pub struct DigestingWriter<W> {
    inner: W,
    hasher: Sha256,
    size: u64,
}

impl<W: std::io::Write> DigestingWriter<W> {
    pub fn new(inner: W) -> Self {
        DigestingWriter { inner, hasher: Sha256::new(), size: 0 }
    }

    /// The writer underneath (writing to it directly bypasses the digest).
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Forgets what was written so far: the digest and size start over (the caller starts
    /// the writer underneath over too: a retried download).
    pub fn restart(&mut self) {
        (self.hasher, self.size) = (Sha256::new(), 0);
    }

    /// The writer back, with the hex sha256 and size of everything written.
    pub fn finish(self) -> (W, String, u64) {
        (self.inner, crate::util::hex(&self.hasher.finalize()), self.size)
    }
}

impl<W: std::io::Write> std::io::Write for DigestingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n.min(buf.len())]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Reads the current version of a source.
pub fn fetch(source: &SourceConfig) -> Result<FetchedLayer, IngestError> {
    match &source.kind {
        SourceKind::File { path } => {
            let bytes = std::fs::read(path).map_err(|e| IngestError::Read { path: path.clone(), source: e })?;
            let digest = digest(&bytes);
            Ok(FetchedLayer { bytes, digest })
        }
        // HTTP kinds are fetched by `ingest::portal` (probe, paging, retries).
        _ => Err(IngestError::Malformed(format!("source {} is an HTTP source; it is fetched by ingest::portal", source.id))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_digesting_reader_digests_everything_also_what_its_consumer_left_unread() {
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        for consumed in [0usize, 1, 4096, 1 << 20, bytes.len()] {
            let mut reader = DigestingReader::new(bytes.as_slice());
            let mut head = vec![0u8; consumed];
            reader.read_exact(&mut head).unwrap();
            assert_eq!(reader.finish().unwrap(), (digest(&bytes), bytes.len() as u64), "consumed {consumed}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("layer.geojson");
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(digest_file(&path).unwrap(), (digest(&bytes), bytes.len() as u64));
    }

    #[test]
    fn a_digesting_writer_digests_what_it_passed_on() {
        use std::io::Write;
        let mut w = DigestingWriter::new(Vec::new());
        w.write_all(b"{\"type\":").unwrap();
        w.write_all(b"\"FeatureCollection\"}").unwrap();
        let (out, d, n) = w.finish();
        assert_eq!((d, n), (digest(&out), out.len() as u64));
        assert_eq!(out, b"{\"type\":\"FeatureCollection\"}");
    }
}
