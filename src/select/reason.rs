//! Why a call went to PyTorch's own kernel: counted in the stats and shown in the logs.

/// Why a call went to PyTorch's own kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StockReason {
    DisabledAtRuntime,
    UnsupportedDtype,
    MixedDtypes,
    UnsupportedSm,
    NoVariantForShape,
    NotFasterHere,
    EmptyInput,
    NothingRequested,
    FormNotServed,
    ScaleGradByFreq,
    UserBackendChoice,
    AttentionFeature,
    InvalidInput,
    SymbolicSizes,
    OpaqueTensor,
    NotContiguous,
    KernelUnavailable,
    LaunchFailed,
    InternalError,
}

impl std::fmt::Display for StockReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StockReason::DisabledAtRuntime => "disabled at run time",
            StockReason::UnsupportedDtype => "unsupported dtype",
            StockReason::MixedDtypes => "mixed input/parameter dtypes",
            StockReason::UnsupportedSm => "GPU architecture not served",
            StockReason::NoVariantForShape => "no variant for this shape",
            StockReason::NotFasterHere => "stock is faster at this shape",
            StockReason::EmptyInput => "empty input",
            StockReason::NothingRequested => "no output requested",
            StockReason::FormNotServed => "a form of the op not served",
            StockReason::ScaleGradByFreq => "scale_grad_by_freq is not served",
            StockReason::UserBackendChoice => "SDPA backends restricted by the user",
            StockReason::AttentionFeature => {
                "attn_mask, dropout, nested inputs or a negative scale are not served"
            }
            StockReason::InvalidInput => "input stock rejects",
            StockReason::SymbolicSizes => "symbolic sizes (a compiler's trace)",
            StockReason::OpaqueTensor => "a tensor subclass or wrapper (its data is not read)",
            StockReason::NotContiguous => "non-contiguous input",
            StockReason::KernelUnavailable => "kernel unavailable",
            StockReason::LaunchFailed => "kernel launch failed",
            StockReason::InternalError => "internal error",
        })
    }
}
