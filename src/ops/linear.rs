//! `torchfuse::linear_cast`: nn.Linear's (or HF Conv1D's) GEMM and reshapes as one autograd
//! node, after autocast's casts where autocast runs (the glue's linear.cpp builds it around
//! stock's casts and kernels; nothing is launched here). This module decides where the node
//! reproduces stock exactly, or says why stock's own nodes run a call.

use super::{Family, KernelOp, Served, Variant};
use crate::abi::tensor::{describe, kind_of_scalar_type};
use crate::abi::types::{TfLinearCall, TfTensor};
use crate::gpu::args::Field;
use crate::gpu::Launch;
use crate::runtime::{Entry, OpFamily};
use crate::select::StockReason;
use tch::Kind;

/// What the stats call a served call: the node, stock's kernels under it; and the node that
/// also casts the weight and bias itself (the `weight_cast` toggle, decided by the glue).
const NODE: &str = "linear_node";
const NODE_WITH_CASTS: &str = "linear_node+weight_cast";

/// The dtypes autocast casts (and so the node's casts take), and those the node computes in
/// (the 16-bit ones under autocast, any of them without): fp32 and the 16-bit ones.
fn castable(kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half)
}

/// Whether the node reproduces stock's Linear (or, `weight_in_out`, HF's Conv1D: the weight
/// [in, out], always a bias) for these facts, or why not. The node computes what stock's
/// formulas compute from the same tensors only for the forms whose stride tests it repeats: a
/// contiguous input of two or more dims, a contiguous 2-D weight, a 1-D bias (or, for a
/// Linear, none), each of a dtype autocast casts (fp32 or 16-bit; their casts are stock's).
pub fn node_serves(
    input: &TfTensor,
    weight: &TfTensor,
    bias: Option<&TfTensor>,
    dtype: Kind,
    weight_in_out: bool,
) -> Result<(), StockReason> {
    if !castable(dtype) {
        return Err(StockReason::UnsupportedDtype);
    }
    let input_kind = input.kind().ok_or(StockReason::UnsupportedDtype)?;
    let weight_kind = weight.kind().ok_or(StockReason::UnsupportedDtype)?;
    if !castable(input_kind)
        || !castable(weight_kind)
        || bias.is_some_and(|b| !b.kind().is_some_and(castable))
    {
        return Err(StockReason::UnsupportedDtype);
    }
    if input.device() != weight.device() || bias.is_some_and(|b| b.device() != weight.device()) {
        return Err(StockReason::InvalidInput);
    }
    let (sizes, weight_sizes) = (input.sizes(), weight.sizes());
    if sizes.len() < 2 || weight_sizes.len() != 2 || (weight_in_out && bias.is_none()) {
        return Err(StockReason::FormNotServed);
    }
    let (out_features, in_features) = if weight_in_out {
        (weight_sizes[1], weight_sizes[0])
    } else {
        (weight_sizes[0], weight_sizes[1])
    };
    if in_features != sizes[sizes.len() - 1] || bias.is_some_and(|b| b.sizes() != [out_features]) {
        return Err(StockReason::InvalidInput);
    }
    if input.numel() == 0 || weight.numel() == 0 {
        return Err(StockReason::EmptyInput);
    }
    if !input.is_contiguous() || !weight.is_contiguous() {
        return Err(StockReason::NotContiguous);
    }
    if !weight_in_out && bias.is_none() && !folds_to_mm(input) {
        return Err(StockReason::FormNotServed);
    }
    Ok(())
}

/// Whether F.linear without a bias runs an input of more than two dims as one mm (the node's
/// GEMM): matmul folds its leading dims where they are a view of one dim, each leading stride
/// the next one's span (`is_contiguous` passes other strides on size-one dims); otherwise, for
/// a weight needing no gradient, it runs bmm. A 2-D input is always an mm; with a bias linear
/// flattens any contiguous input itself.
fn folds_to_mm(input: &TfTensor) -> bool {
    let (sizes, strides) = (input.sizes(), input.strides());
    let leading = sizes.len().saturating_sub(2);
    (0..leading).all(|i| strides[i] == strides[i + 1] * sizes[i + 1])
}

pub struct Linear;

impl Family for Linear {
    type Call = TfLinearCall;

    const FAMILY: OpFamily = OpFamily::Linear;

    unsafe fn unreadable(_entry: Entry, call: &TfLinearCall) -> Option<&TfTensor> {
        // Nothing is launched: only the sizes and strides are read.
        TfTensor::first_unreadable(&[&call.input, &call.weight, &call.bias], false)
    }

    unsafe fn describe(_entry: Entry, call: &TfLinearCall) -> Option<(&'static str, Vec<i64>)> {
        let (kind, mut shape) = describe(call.input.given()?);
        let weight_sizes = call.weight.given()?.sizes();
        let out_features = if call.weight_in_out != 0 {
            weight_sizes.get(1)
        } else {
            weight_sizes.first()
        };
        shape.push(*out_features?);
        Some((kind, shape))
    }

    unsafe fn serve(
        _entry: Entry,
        _launch: Launch,
        call: &TfLinearCall,
        _shape: &[i64],
    ) -> Result<Served, StockReason> {
        let input = call.input.given().ok_or(StockReason::InvalidInput)?;
        let weight = call.weight.given().ok_or(StockReason::InvalidInput)?;
        let dtype = kind_of_scalar_type(call.dtype).ok_or(StockReason::UnsupportedDtype)?;
        node_serves(
            input,
            weight,
            call.bias.given(),
            dtype,
            call.weight_in_out != 0,
        )?;
        let name = if call.casts_in_node != 0 {
            NODE_WITH_CASTS
        } else {
            NODE
        };
        Ok(Served::new(name, [None, None, None]))
    }

    fn kernels(_op: KernelOp) -> &'static [&'static str] {
        &[]
    }

    fn kernel_args(_kernel: &str) -> Option<&'static [Field]> {
        None
    }

    fn defines(_op: KernelOp) -> Vec<String> {
        Vec::new()
    }

    type Params = ();

    fn prepare(v: &Variant) -> Result<(), String> {
        Err(format!(
            "{}: the linear family has no kernels of its own",
            v.name
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::tensor::described;
    use tch::{Device, Tensor};

    fn t(shape: &[i64], kind: Kind) -> Tensor {
        Tensor::zeros(shape, (kind, Device::Cpu))
    }

    #[test]
    fn the_node_serves_contiguous_castable_forms_and_says_why_not_otherwise() {
        let (bf16, f32) = (Kind::BFloat16, Kind::Float);
        // The facts point into the tensors' own size arrays: the tensors outlive them.
        let (x3, w32, b32) = (t(&[4, 5, 16], f32), t(&[12, 16], f32), t(&[12], f32));
        let (x, w, b) = (described(&x3), described(&w32), described(&b32));
        assert_eq!(node_serves(&x, &w, Some(&b), bf16, false), Ok(()));
        assert_eq!(node_serves(&x, &w, None, Kind::Half, false), Ok(()));
        let served = |x: &Tensor, w: &Tensor, b: Option<&Tensor>, dtype| {
            let b = b.map(described);
            node_serves(&described(x), &described(w), b.as_ref(), dtype, false)
        };
        let (x, w) = (t(&[4, 16], bf16), t(&[12, 16], f32));
        // Without autocast a Linear computes in its tensors' dtype, fp32 included.
        assert_eq!(served(&w, &w, None, f32), Ok(()));
        assert_eq!(
            served(&x, &w, None, Kind::Double),
            Err(StockReason::UnsupportedDtype)
        );
        let double = t(&[12, 16], Kind::Double);
        assert_eq!(
            served(&x, &double, None, bf16),
            Err(StockReason::UnsupportedDtype)
        );
        let ints = t(&[12], Kind::Int64);
        assert_eq!(
            served(&x, &w, Some(&ints), bf16),
            Err(StockReason::UnsupportedDtype)
        );
        assert_eq!(
            served(&t(&[16], bf16), &w, None, bf16),
            Err(StockReason::FormNotServed)
        );
        assert_eq!(
            served(&t(&[4, 15], bf16), &w, None, bf16),
            Err(StockReason::InvalidInput)
        );
        assert_eq!(
            served(&x, &w, Some(&t(&[11], f32)), bf16),
            Err(StockReason::InvalidInput)
        );
        assert_eq!(
            served(&t(&[0, 16], bf16), &w, None, bf16),
            Err(StockReason::EmptyInput)
        );
        let transposed = t(&[16, 4], bf16).transpose(0, 1);
        assert_eq!(
            served(&transposed, &w, None, bf16),
            Err(StockReason::NotContiguous)
        );
        let w_t = t(&[16, 12], f32).transpose(0, 1);
        assert_eq!(
            served(&x, &w_t, None, bf16),
            Err(StockReason::NotContiguous)
        );
        // Contiguous, but a size-one dim's stride is not its span: without a bias matmul runs bmm
        // there (for a frozen weight); with one, linear flattens it.
        let odd = t(&[2, 3, 1, 16], bf16).transpose(1, 2);
        assert_eq!(
            served(&odd, &w, None, bf16),
            Err(StockReason::FormNotServed)
        );
        assert_eq!(served(&odd, &w, Some(&t(&[12], f32)), bf16), Ok(()));
        assert_eq!(served(&t(&[2, 1, 3, 16], bf16), &w, None, bf16), Ok(()));
        // HF Conv1D's weight, [in, out], and its bias: served; without a bias, stock's code.
        let conv1d = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| {
            let b = b.map(described);
            node_serves(&described(x), &described(w), b.as_ref(), bf16, true)
        };
        let (x, w_in_out) = (t(&[4, 5, 16], bf16), t(&[16, 12], f32));
        assert_eq!(conv1d(&x, &w_in_out, Some(&t(&[12], f32))), Ok(()));
        assert_eq!(conv1d(&x, &w_in_out, None), Err(StockReason::FormNotServed));
        assert_eq!(
            conv1d(&x, &w_in_out, Some(&t(&[16], f32))),
            Err(StockReason::InvalidInput)
        );
        assert_eq!(
            conv1d(&t(&[4, 12], bf16), &w_in_out, Some(&t(&[12], f32))),
            Err(StockReason::InvalidInput)
        );
    }
}
