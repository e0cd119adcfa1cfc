//! The IDX format of (Fashion-)MNIST: a big-endian magic number `0x0000_08NN` (unsigned bytes,
//! `NN` dimensions), one big-endian `u32` per dimension, then the values. Files may be gzipped.

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::Path;

use flate2::read::GzDecoder;

use super::DataError;

/// The IDX type code of unsigned bytes, the only one the datasets use.
const UBYTE: u8 = 0x08;
/// Refuse to inflate more than this: a real Fashion-MNIST file is 47 MB.
const MAX_DECODED_BYTES: u64 = 1 << 30;

/// An n-dimensional array of bytes read from an IDX file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxArray {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Reads an IDX file of bytes with `ndim` dimensions; gzip is detected from the content.
pub fn read(path: &Path, ndim: u8) -> Result<IdxArray, DataError> {
    let io_err = |source| DataError::Io {
        path: path.to_owned(),
        source,
    };
    let mut raw = Vec::new();
    File::open(path)
        .and_then(|f| f.take(MAX_DECODED_BYTES).read_to_end(&mut raw))
        .map_err(io_err)?;
    decode(path, raw, ndim)
}

/// Decodes the bytes of an IDX file (gzipped or not) of bytes with `ndim` dimensions; `path`
/// is only named in errors.
pub fn decode(path: &Path, mut raw: Vec<u8>, ndim: u8) -> Result<IdxArray, DataError> {
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut inflated = Vec::new();
        GzDecoder::new(raw.as_slice())
            .take(MAX_DECODED_BYTES)
            .read_to_end(&mut inflated)
            .map_err(|e| DataError::Corrupt {
                path: path.to_owned(),
                reason: format!("gzip stream broken ({e})"),
            })?;
        raw = inflated;
    }
    parse(path, &raw, ndim)
}

fn parse(path: &Path, bytes: &[u8], ndim: u8) -> Result<IdxArray, DataError> {
    let expected_magic = u32::from_be_bytes([0, 0, UBYTE, ndim]);
    let header_len = 4 + 4 * usize::from(ndim);
    let magic = bytes
        .get(..4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    match magic {
        Some(m) if m == expected_magic => {}
        Some(found) => {
            return Err(DataError::BadMagic {
                path: path.to_owned(),
                found,
                expected: expected_magic,
            });
        }
        None => {
            return Err(DataError::Truncated {
                path: path.to_owned(),
                expected: header_len as u64,
                actual: bytes.len() as u64,
            });
        }
    }
    if bytes.len() < header_len {
        return Err(DataError::Truncated {
            path: path.to_owned(),
            expected: header_len as u64,
            actual: bytes.len() as u64,
        });
    }
    let dims: Vec<usize> = bytes[4..header_len]
        .chunks_exact(4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .collect();
    let expected = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&n| n <= MAX_DECODED_BYTES)
        .ok_or_else(|| DataError::Corrupt {
            path: path.to_owned(),
            reason: format!("dimensions {dims:?} are impossibly large"),
        })?;
    let body = &bytes[header_len..];
    let actual = body.len() as u64;
    if actual < expected {
        return Err(DataError::Truncated {
            path: path.to_owned(),
            expected,
            actual,
        });
    }
    if actual > expected {
        return Err(DataError::Corrupt {
            path: path.to_owned(),
            reason: format!(
                "{} bytes follow the {expected} its header declares",
                actual - expected
            ),
        });
    }
    Ok(IdxArray {
        dims,
        data: body.to_vec(),
    })
}

/// Writes an uncompressed IDX file of bytes.
pub fn write(path: &Path, dims: &[usize], data: &[u8]) -> io::Result<()> {
    let ndim = u8::try_from(dims.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many IDX dimensions"))?;
    let mut out = BufWriter::new(File::create(path)?);
    out.write_all(&[0, 0, UBYTE, ndim])?;
    for &d in dims {
        let d = u32::try_from(d)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "IDX dimension over u32"))?;
        out.write_all(&d.to_be_bytes())?;
    }
    out.write_all(data)?;
    out.into_inner().map_err(|e| e.into_error())?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use proptest::prelude::*;

    fn temp_file(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn reads_raw_and_gzipped_files() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("x-idx3-ubyte");
        write(&raw, &[2, 2, 3], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).unwrap();
        let arr = read(&raw, 3).unwrap();
        assert_eq!(arr.dims, [2, 2, 3]);
        assert_eq!(arr.data[11], 12);

        let mut gz = GzEncoder::new(Vec::new(), Compression::fast());
        gz.write_all(&std::fs::read(&raw).unwrap()).unwrap();
        let f = temp_file(&gz.finish().unwrap());
        assert_eq!(read(f.path(), 3).unwrap(), arr);
    }

    #[test]
    fn wrong_magic_is_named() {
        let f = temp_file(&[0, 0, 8, 1, 0, 0, 0, 1, 7]);
        let err = read(f.path(), 3).unwrap_err();
        assert!(
            matches!(err, DataError::BadMagic { found: 0x0801, .. }),
            "{err}"
        );
        let f = temp_file(b"PK\x03\x04 not idx at all");
        assert!(matches!(
            read(f.path(), 1).unwrap_err(),
            DataError::BadMagic { .. }
        ));
    }

    #[test]
    fn truncated_body_and_header_are_named() {
        let f = temp_file(&[0, 0, 8, 1, 0, 0, 0, 5, 1, 2]);
        let err = read(f.path(), 1).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::Truncated {
                    expected: 5,
                    actual: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("truncated"));
        let f = temp_file(&[0, 0, 8, 3, 0, 0]);
        assert!(matches!(
            read(f.path(), 3).unwrap_err(),
            DataError::Truncated { .. }
        ));
        let f = temp_file(&[0, 0]);
        assert!(matches!(
            read(f.path(), 1).unwrap_err(),
            DataError::Truncated { .. }
        ));
    }

    #[test]
    fn trailing_bytes_and_broken_gzip_are_corrupt() {
        let f = temp_file(&[0, 0, 8, 1, 0, 0, 0, 1, 1, 2]);
        assert!(matches!(
            read(f.path(), 1).unwrap_err(),
            DataError::Corrupt { .. }
        ));
        let f = temp_file(&[0x1f, 0x8b, 8, 0, 1, 2, 3]);
        assert!(matches!(
            read(f.path(), 1).unwrap_err(),
            DataError::Corrupt { .. }
        ));
    }

    proptest! {
        #[test]
        fn never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse(Path::new("fuzz"), &bytes, 3);
        }

        #[test]
        fn write_then_read_round_trips(dims in proptest::collection::vec(1usize..5, 1..4), seed in any::<u8>()) {
            let n: usize = dims.iter().product();
            let data: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("a");
            write(&path, &dims, &data).unwrap();
            let arr = read(&path, dims.len() as u8).unwrap();
            prop_assert_eq!(arr.dims, dims);
            prop_assert_eq!(arr.data, data);
        }
    }
}
