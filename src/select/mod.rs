//! Selection: the registry data (`registry/*.toml`), the dtypes it names and the reasons a
//! call goes to stock. Knows nothing of individual ops or of the GPU.

pub mod dtype;
pub mod reason;
pub mod registry;

pub use dtype::{dtype_of, kind_name, DType};
pub use reason::StockReason;
pub use registry::{OpKey, Registry, Request, Variant};

/// The registry data built into the library, so a copied `.so` is complete.
pub const REGISTRY_FILES: &[(&str, &str)] = &[
    ("adam.toml", include_str!("../../registry/adam.toml")),
    (
        "attention.toml",
        include_str!("../../registry/attention.toml"),
    ),
    (
        "column_sum.toml",
        include_str!("../../registry/column_sum.toml"),
    ),
    (
        "cross_entropy.toml",
        include_str!("../../registry/cross_entropy.toml"),
    ),
    (
        "embedding.toml",
        include_str!("../../registry/embedding.toml"),
    ),
    ("gelu.toml", include_str!("../../registry/gelu.toml")),
    (
        "mixed_add.toml",
        include_str!("../../registry/mixed_add.toml"),
    ),
    ("norm.toml", include_str!("../../registry/norm.toml")),
    ("rotary.toml", include_str!("../../registry/rotary.toml")),
    ("swiglu.toml", include_str!("../../registry/swiglu.toml")),
];
