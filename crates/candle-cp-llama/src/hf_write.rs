//! Safetensors files as the checkpoint writers write them: the header, each tensor's
//! little-endian bytes, streamed one tensor at a time ([`stream_safetensors`]), every file
//! written to a temporary name and renamed into place ([`write_atomic`]).

use super::io_err;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

fn st_dtype(d: DType) -> Result<&'static str> {
    Ok(match d {
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::F64 => "F64",
        DType::U32 => "U32",
        other => bail!("save_hf: dtype {other:?} not supported (f32, bf16, f16, f64, u32)"),
    })
}

fn le_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => t.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U32 => t.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        other => bail!("save_hf: dtype {other:?} not supported"),
    })
}

/// Write `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes).map_err(|e| io_err("writing", path, e)))
}

/// [`write_atomic`] of what `write` writes (buffered) to the temporary file.
pub(super) fn write_atomic_with(path: &Path, write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<()>) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let res = (|| -> Result<()> {
        let f = std::fs::File::create(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
        let mut w = std::io::BufWriter::new(f);
        write(&mut w)?;
        let f = w.into_inner().map_err(|e| io_err("writing", &tmp, e.error()))?;
        f.sync_all().map_err(|e| io_err("syncing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err("renaming to", path, e))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// The safetensors header (length prefix + JSON, padded to 8 bytes) of tensors `(name,
/// shape, dtype)` in the order given, each tensor's data following the previous one's.
fn safetensors_header(entries: &[(&str, &[usize], DType)]) -> Result<Vec<u8>> {
    let mut header = BTreeMap::new();
    let mut at = 0usize;
    for &(name, shape, dtype) in entries {
        let len = shape.iter().product::<usize>() * dtype.size_in_bytes();
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": st_dtype(dtype)?, "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    header.insert("__metadata__".to_string(), serde_json::json!({"format": "pt"}));
    let mut h = serde_json::to_vec(&header).map_err(|e| candle_core::Error::Msg(format!("safetensors header: {e}")))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    Ok(out)
}

/// Serialise named tensors (keys sorted, metadata `format: pt`) to `w`, one tensor's bytes
/// at a time.
pub(super) fn write_safetensors(w: &mut impl Write, tensors: &[(String, Tensor)], path: &Path) -> Result<()> {
    let mut sorted: Vec<&(String, Tensor)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let entries: Vec<(&str, &[usize], DType)> = sorted.iter().map(|(n, t)| (n.as_str(), t.dims(), t.dtype())).collect();
    w.write_all(&safetensors_header(&entries)?).map_err(|e| io_err("writing", path, e))?;
    for (_, t) in sorted {
        w.write_all(&le_bytes(t)?).map_err(|e| io_err("writing", path, e))?;
    }
    Ok(())
}

/// Serialise named tensors as one safetensors file (keys sorted, metadata `format: pt`).
pub fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    write_safetensors(&mut out, tensors, Path::new("memory"))?;
    Ok(out)
}

/// Write the safetensors file `path` (its directory created if needed) whose tensors
/// `entries` (name, shape, dtype) come one at a time from `next(i)`, in the order given: the
/// header is built from the entries, then each tensor's bytes are appended as it arrives
/// (temporary name, fsync, rename). `next` is called for every entry whether or not this rank
/// writes and whatever happened to its writing, so collectives inside it stay in step across
/// ranks; a write error (or a tensor that does not match its entry) is returned at the end.
pub(crate) fn stream_safetensors(
    path: &Path,
    entries: &[(String, Vec<usize>, DType)],
    write: bool,
    mut next: impl FnMut(usize) -> Result<Tensor>,
) -> Result<()> {
    let tmp = {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
        path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
    };
    let mut sink: Option<Result<std::io::BufWriter<std::fs::File>>> = write.then(|| {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
        let list: Vec<(&str, &[usize], DType)> = entries.iter().map(|(n, s, d)| (n.as_str(), s.as_slice(), *d)).collect();
        let header = safetensors_header(&list)?;
        let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| io_err("creating", &tmp, e))?);
        w.write_all(&header).map_err(|e| io_err("writing", &tmp, e))?;
        Ok(w)
    });
    for (i, (name, shape, dtype)) in entries.iter().enumerate() {
        let t = next(i)?;
        if let Some(Ok(w)) = &mut sink {
            let res = if t.dims() != shape.as_slice() || t.dtype() != *dtype {
                Err(candle_core::Error::Msg(format!(
                    "{}: tensor {name} is {:?} {:?}, its header entry {shape:?} {dtype:?}",
                    path.display(),
                    t.dims(),
                    t.dtype()
                )))
            } else {
                le_bytes(&t).and_then(|b| w.write_all(&b).map_err(|e| io_err("writing", &tmp, e)))
            };
            if let Err(e) = res {
                sink = Some(Err(e));
            }
        }
    }
    let Some(sink) = sink else { return Ok(()) };
    let done = sink.and_then(|w| {
        let f = w.into_inner().map_err(|e| io_err("writing", &tmp, e.error()))?;
        f.sync_all().map_err(|e| io_err("syncing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err("renaming to", path, e))
    });
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

