//! Kernel sources, built into the library so a copied `.so` is complete.

pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("adam.cu", include_str!("../../kernels/adam.cu")),
    ("attention.cu", include_str!("../../kernels/attention.cu")),
    (
        "attention_bwd_sm80.cuh",
        include_str!("../../kernels/attention_bwd_sm80.cuh"),
    ),
    (
        "attention_bwd_sm90.cuh",
        include_str!("../../kernels/attention_bwd_sm90.cuh"),
    ),
    (
        "attention_fwd_sm80.cuh",
        include_str!("../../kernels/attention_fwd_sm80.cuh"),
    ),
    (
        "attention_fwd_sm90.cuh",
        include_str!("../../kernels/attention_fwd_sm90.cuh"),
    ),
    ("column_sum.cu", include_str!("../../kernels/column_sum.cu")),
    ("common.cuh", include_str!("../../kernels/common.cuh")),
    (
        "cross_entropy.cu",
        include_str!("../../kernels/cross_entropy.cu"),
    ),
    (
        "elementwise.cuh",
        include_str!("../../kernels/elementwise.cuh"),
    ),
    ("embedding.cu", include_str!("../../kernels/embedding.cu")),
    ("gelu.cu", include_str!("../../kernels/gelu.cu")),
    ("gelu_tanh.cuh", include_str!("../../kernels/gelu_tanh.cuh")),
    ("mixed_add.cu", include_str!("../../kernels/mixed_add.cu")),
    ("norm.cu", include_str!("../../kernels/norm.cu")),
    ("rotary.cu", include_str!("../../kernels/rotary.cu")),
    ("swiglu.cu", include_str!("../../kernels/swiglu.cu")),
];

pub fn kernel_source(name: &str) -> Option<&'static str> {
    KERNEL_SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
}

/// Headers every kernel compilation may `#include`.
pub fn headers() -> impl Iterator<Item = (&'static str, &'static str)> {
    KERNEL_SOURCES
        .iter()
        .copied()
        .filter(|(n, _)| n.ends_with(".cuh"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files_in(dir: &str) -> Vec<String> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let mut names: Vec<String> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn every_file_in_kernels_and_registry_is_built_in() {
        let mut kernels: Vec<String> = KERNEL_SOURCES.iter().map(|(n, _)| n.to_string()).collect();
        kernels.sort();
        assert_eq!(files_in("kernels"), kernels);
        let mut registry: Vec<String> = crate::select::REGISTRY_FILES
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        registry.sort();
        assert_eq!(files_in("registry"), registry);
    }
}
