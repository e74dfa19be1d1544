//! The CUBIN disk cache: one file per (source, headers, options, architecture, NVRTC
//! version), checked on read, written atomically, so processes can share it.

use super::nvrtc::{nvrtc_compile, nvrtc_ready, nvrtc_version};
use std::path::Path;

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Everything that determines a CUBIN: source, headers, options, architecture, NVRTC.
pub fn cache_key(source: &str, options: &[String], arch: &str) -> u64 {
    let (major, minor) = nvrtc_version();
    let mut parts: Vec<&[u8]> = vec![source.as_bytes(), arch.as_bytes()];
    let version = format!(
        "nvrtc {major}.{minor} torchfuse {}",
        env!("CARGO_PKG_VERSION")
    );
    parts.push(version.as_bytes());
    let headers: Vec<(&str, &str)> = super::sources::headers().collect();
    for (name, text) in &headers {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    for o in options {
        parts.push(o.as_bytes());
    }
    fnv1a(&parts)
}

const CACHE_MAGIC: &[u8; 8] = b"TFCUBIN\x01";
const CACHE_HEADER: usize = 32;

/// A cached CUBIN, or None if the file is missing, truncated, foreign or corrupt.
pub fn read_cached(path: &Path, key: u64) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.len() < CACHE_HEADER || &bytes[..8] != CACHE_MAGIC {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
    let payload = &bytes[CACHE_HEADER..];
    (word(8) == key && word(16) == payload.len() as u64 && word(24) == fnv1a(&[payload]))
        .then(|| payload.to_vec())
}

/// Writes atomically (temp file + rename), so a reader never sees a partial file.
pub fn write_cached(path: &Path, key: u64, payload: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut bytes = Vec::with_capacity(CACHE_HEADER + payload.len());
    bytes.extend_from_slice(CACHE_MAGIC);
    bytes.extend_from_slice(&key.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a(&[payload]).to_le_bytes());
    bytes.extend_from_slice(payload);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = path.with_extension(format!("tmp.{}.{nanos}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A CUBIN of `source_name` compiled with `options` for `arch`, from the disk cache or freshly
/// compiled; `label` names it in the logs.
pub fn cubin(
    label: &str,
    source_name: &str,
    options: &[String],
    arch: &str,
    cache_dir: &Path,
) -> Result<Vec<u8>, String> {
    nvrtc_ready()?;
    let source = super::sources::kernel_source(source_name)
        .ok_or_else(|| format!("no kernel source {source_name}"))?;
    let key = cache_key(source, options, arch);
    let path = cache_dir.join(format!("{key:016x}-{arch}.cubin"));
    if let Some(bytes) = read_cached(&path, key) {
        tracing::debug!("{label} {arch}: cubin from cache {path:?}");
        return Ok(bytes);
    }
    let started = std::time::Instant::now();
    let bytes = nvrtc_compile(source_name, options)?;
    tracing::debug!(
        "{label} {arch}: compiled in {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    if let Err(e) = write_cached(&path, key, &bytes) {
        tracing::debug!("cannot write kernel cache {path:?}: {e}");
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_round_trip_and_rejections() {
        let dir = std::env::temp_dir().join(format!("torchfuse-cache-test-{}", std::process::id()));
        let path = dir.join("k.cubin");
        let payload = b"not really a cubin, but bytes".to_vec();
        write_cached(&path, 42, &payload).unwrap();
        assert_eq!(read_cached(&path, 42), Some(payload.clone()));
        // Another key's file is foreign.
        assert_eq!(read_cached(&path, 43), None);
        // Truncated.
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 3]).unwrap();
        assert_eq!(read_cached(&path, 42), None);
        // Same length, one byte flipped.
        let mut flipped = full.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert_eq!(read_cached(&path, 42), None);
        // Not ours at all.
        std::fs::write(&path, b"\x7fELF").unwrap();
        assert_eq!(read_cached(&path, 42), None);
        // A rewrite replaces it.
        write_cached(&path, 42, &payload).unwrap();
        assert_eq!(read_cached(&path, 42), Some(payload));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cache_key_depends_on_every_input() {
        // The key includes NVRTC's version: map libtorch (linked, maybe deferred) so NVRTC
        // is found next to it.
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        let _ = super::nvrtc_ready();
        let o = |s: &str| vec![s.to_string()];
        let base = cache_key("src", &o("-DA=1"), "sm_90a");
        assert_eq!(base, cache_key("src", &o("-DA=1"), "sm_90a"));
        assert_ne!(base, cache_key("src2", &o("-DA=1"), "sm_90a"));
        assert_ne!(base, cache_key("src", &o("-DA=2"), "sm_90a"));
        assert_ne!(base, cache_key("src", &o("-DA=1"), "sm_80"));
    }
}
