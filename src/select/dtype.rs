//! The floating-point dtypes the kernels are compiled for, and how tch's kinds and
//! `c10::ScalarType` codes map to them.

use serde::Deserialize;
use tch::Kind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
pub enum DType {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    BF16,
    #[serde(rename = "f16")]
    F16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Elements in one 16-byte vector (`TF_VEC` in the kernels).
    pub fn vector_elems(self) -> i64 {
        (16 / self.size_bytes()) as i64
    }

    /// The value of `TF_DTYPE` the kernels are compiled with.
    pub fn kernel_code(self) -> i64 {
        match self {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
        }
    }
}

/// The kernel dtype of a tch kind, if the kernels serve it.
pub fn dtype_of(kind: Kind) -> Option<DType> {
    match kind {
        Kind::Float => Some(DType::F32),
        Kind::BFloat16 => Some(DType::BF16),
        Kind::Half => Some(DType::F16),
        _ => None,
    }
}

/// The name a kind is logged and counted under.
pub fn kind_name(kind: Option<Kind>) -> &'static str {
    match kind {
        Some(k) => match dtype_of(k) {
            Some(d) => d.name(),
            None => match k {
                Kind::Double => "f64",
                Kind::Int64 => "i64",
                Kind::Int => "i32",
                Kind::Uint8 => "u8",
                Kind::Bool => "bool",
                _ => "other",
            },
        },
        None => "none",
    }
}
