//! torchfuse: fused CUDA kernels swapped in for PyTorch's own at the dispatcher.
//!
//! Loaded into a PyTorch process (by `libtorchfuse_preload.so` or `torch.ops.load_library`),
//! it registers overrides for the enabled aten ops at the CUDA key. A call's path, and the
//! layers, each depending only on those after it:
//!
//! - `abi`: the C++ glue and the Rust entry points (the boundary with PyTorch);
//! - `ops`: one module per op family: checks the call, plans and launches its kernels;
//! - `gpu`: NVRTC, the CUBIN cache, devices and streams, the module store;
//! - `runtime`: config, logging, stats, toggles;
//! - `select`: the registry data (`registry/*.toml`), dtypes, stock reasons.
//!
//! A call the registry has no variant for, or that fails anywhere, runs PyTorch's own kernel
//! with a logged reason.

pub mod abi;
pub mod gpu;
pub mod ops;
pub mod runtime;
pub mod select;

#[cfg(test)]
mod tests {
    /// The layers of the call path, lowest first: a module uses only modules of lower layers
    /// (and its own), so there is no import loop. `abi::types` and `abi::tensor` are the
    /// boundary's vocabulary, used below the entry points that sit on top.
    fn layer(module: &str) -> u32 {
        match module {
            "select" => 0,
            "abi::types" | "runtime" => 1,
            "abi::tensor" => 2,
            "gpu" => 3,
            "ops" => 4,
            _ => 5, // the rest of abi: entry points, lifecycle, control
        }
    }

    /// The module a `crate::` path or a file under src/ belongs to.
    fn module_of(path: &str) -> String {
        let mut parts = path.split("::");
        let top = parts.next().unwrap_or_default().to_string();
        match (top.as_str(), parts.next()) {
            ("abi", Some(sub @ ("types" | "tensor"))) => format!("abi::{sub}"),
            _ => top,
        }
    }

    #[test]
    fn every_module_uses_only_lower_layers() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut checked = 0;
        for dir in ["abi", "gpu", "ops", "runtime", "select"] {
            for entry in std::fs::read_dir(src.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
                let own = module_of(&format!("{dir}::{stem}"));
                let text = std::fs::read_to_string(&path).unwrap();
                // Tests may reach anything.
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                // `super::` in a file of a folder is that folder's module (in mod.rs, the crate).
                let uses = code
                    .match_indices("crate::")
                    .map(|(i, m)| (i + m.len(), String::new()))
                    .chain(
                        code.match_indices("super::")
                            .filter(|_| stem != "mod")
                            .map(|(i, m)| (i + m.len(), format!("{dir}::"))),
                    );
                for (start, prefix) in uses {
                    let rest = &code[start..];
                    let end = rest
                        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                        .unwrap_or(rest.len());
                    let used = module_of(&format!("{prefix}{}", &rest[..end]));
                    // Within a folder, files may use each other; abi's vocabulary is layered.
                    let same_folder = used.split("::").next() == Some(dir) && dir != "abi";
                    if used != own && !same_folder {
                        assert!(
                            layer(&used) < layer(&own),
                            "{} ({own}) uses {used}, a layer above or beside it",
                            path.display()
                        );
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 20, "only {checked} uses found");
    }
}
