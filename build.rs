//! Compiles the thin C++ dispatcher glue against the torch found in the project's Python
//! (the same way torch-sys does with LIBTORCH_USE_PYTORCH=1) and links it into libtorchfuse.

use std::path::PathBuf;
use std::process::Command;

const PROBE: &str = r#"
import os, torch
root = os.path.dirname(torch.__file__)
print("TORCH_ROOT=" + root)
print("CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
print("VERSION=" + torch.__version__)
"#;

fn main() {
    println!("cargo:rerun-if-changed=src/abi/glue");
    println!("cargo:rerun-if-changed=src/abi/torchfuse_abi.h");
    println!("cargo:rerun-if-env-changed=TORCHFUSE_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let python = std::env::var("TORCHFUSE_PYTHON").unwrap_or_else(|_| {
        if std::env::var_os("VIRTUAL_ENV").is_some() {
            "python".into()
        } else {
            "python3".into()
        }
    });
    let output = Command::new(&python)
        .arg("-c")
        .arg(PROBE)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}; run scripts/setup first"));
    assert!(
        output.status.success(),
        "{python} could not import torch: {}\nrun scripts/setup first",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    let field = |key: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("torch probe did not print {key}: {text}"))
            .to_string()
    };
    let torch_root = PathBuf::from(field("TORCH_ROOT"));
    let version = field("VERSION");
    assert!(
        version.starts_with("2.11.0"),
        "torchfuse is built against torch 2.11.0, found {version}"
    );
    // What `torchfuse doctor` reports and the Python side checks the running torch against.
    println!("cargo:rustc-env=TORCHFUSE_TORCH_VERSION={version}");

    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .opt_level(2)
        .include(torch_root.join("include"))
        .include(torch_root.join("include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", field("CXX11_ABI").as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .flag("-fvisibility=hidden")
        .flag("-Wno-unused-parameter")
        .files(glue_sources())
        .compile("torchfuse_glue");

    let lib_dir = torch_root.join("lib");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    for lib in ["torch_cuda", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}

/// The glue's files (src/abi/glue/*.cpp: one per op family, the shared calls, registration),
/// in a stable order.
fn glue_sources() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir("src/abi/glue")
        .expect("src/abi/glue is part of the source tree")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "cpp"))
        .collect();
    files.sort();
    files
}
