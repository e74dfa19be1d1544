//! Adam and AdamW (`_fused_adam_`, `_fused_adamw_`, float and tensor lr): one multi-tensor
//! step through kernels/adam.cu, or why stock runs a call.
//!
//! The C++ glue describes every tensor of the lists in a `TfTensor` (pointer, size, dtype,
//! device, layout), so per-tensor work here is plain memory reads, not calls into libtorch.
//! Calls stock would reject go to stock, so the user gets stock's error.

use super::params::{self, flag, one};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::types::{
    TfAdamCall, TfTensor, SCALAR_BFLOAT16, SCALAR_DOUBLE, SCALAR_FLOAT, SCALAR_HALF,
};
use crate::gpu::args::Field;
use crate::gpu::Launch;
use crate::runtime::{Entry, OpFamily};
use crate::select::{DType, StockReason};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use serde::{Deserialize, Serialize};

/// Tensors one launch carries in its parameter space (`TF_ADAM_MAX_TENSORS` in the kernel).
/// 56 + 64 * 500 bytes fits the 32 KB parameter limit of CUDA 12.1+ on sm_70 and later.
pub const MAX_TENSORS_PER_LAUNCH: usize = 500;

pub fn dtype_from_scalar_type(code: i16) -> Option<DType> {
    match code {
        SCALAR_FLOAT => Some(DType::F32),
        SCALAR_BFLOAT16 => Some(DType::BF16),
        SCALAR_HALF => Some(DType::F16),
        _ => None,
    }
}

pub fn scalar_type_name(code: i16) -> &'static str {
    match dtype_from_scalar_type(code) {
        Some(d) => d.name(),
        None if code == SCALAR_DOUBLE => "f64",
        None => "other",
    }
}

/// Lists of different lengths: stock's kernel indexes every list by the params' positions
/// and reads past the shorter one (a crash, verified on the H100), so this is refused with an
/// error instead. Only the lists stock reads count (max_exp_avg_sqs under amsgrad).
fn list_length_error(c: &TfAdamCall, op: &str) -> Option<String> {
    let mut names = vec!["params", "grads", "exp_avgs", "exp_avg_sqs"];
    let mut lens = vec![c.lens[0], c.lens[1], c.lens[2], c.lens[3]];
    if c.amsgrad != 0 {
        names.push("max_exp_avg_sqs");
        lens.push(c.lens[4]);
    }
    names.push("state_steps");
    lens.push(c.lens[5]);
    if lens.iter().all(|&l| l == lens[0]) {
        return None;
    }
    let got: Vec<String> = lens.iter().map(|l| l.to_string()).collect();
    Some(format!(
        "{op}: {} must have the same number of tensors, got {}",
        names.join(", "),
        got.join(", ")
    ))
}

/// The call's tensor lists, borrowed from the C++ frame.
struct AdamCall<'a> {
    pub params: &'a [TfTensor],
    pub grads: &'a [TfTensor],
    pub exp_avgs: &'a [TfTensor],
    pub exp_avg_sqs: &'a [TfTensor],
    pub max_exp_avg_sqs: &'a [TfTensor],
    pub steps: &'a [TfTensor],
    pub lr_tensor: Option<&'a TfTensor>,
    pub grad_scale: Option<&'a TfTensor>,
    pub found_inf: Option<&'a TfTensor>,
    pub c: &'a TfAdamCall,
}

impl<'a> AdamCall<'a> {
    /// # Safety
    /// Every non-null pointer of `c` points to as many `TfTensor` as its length says, alive
    /// for `'a`.
    pub unsafe fn from_c(c: &'a TfAdamCall) -> AdamCall<'a> {
        let list = |i: usize| -> &'a [TfTensor] {
            if c.lists[i].is_null() || c.lens[i] == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(c.lists[i], c.lens[i])
            }
        };
        AdamCall {
            params: list(0),
            grads: list(1),
            exp_avgs: list(2),
            exp_avg_sqs: list(3),
            max_exp_avg_sqs: list(4),
            steps: list(5),
            lr_tensor: c.lr_tensor.present().then_some(&c.lr_tensor),
            grad_scale: c.grad_scale.present().then_some(&c.grad_scale),
            found_inf: c.found_inf.present().then_some(&c.found_inf),
            c,
        }
    }

    /// For logs and stats: the params' dtype, and [tensors, elements].
    pub fn describe(&self) -> (&'static str, Vec<i64>) {
        let dtype = self
            .params
            .first()
            .map_or("none", |p| scalar_type_name(p.dtype));
        let elements = self.params.iter().map(|p| p.numel.max(0)).sum::<i64>();
        (dtype, vec![self.params.len() as i64, elements])
    }
}

/// An Adam variant's compile-time params (`registry/adam.toml`), checked once.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Threads per CTA: a multiple of 32.
    threads: i64,
    /// 16-byte accesses per lane per array in one unit.
    unroll: i64,
    /// CTAs per SM the register budget must allow (`__launch_bounds__`).
    #[serde(default = "one")]
    min_blocks: i64,
    /// 16-byte accesses carry the streaming cache hint.
    #[serde(default, with = "flag")]
    streaming: bool,
}

/// An Adam variant's params, and their limits.
fn prepare(v: &Variant) -> Result<Params, String> {
    let p: Params = params::parse(v)?;
    if !(32..=1024).contains(&p.threads) || p.threads % 32 != 0 {
        return Err(format!(
            "{}: THREADS {} must be a multiple of 32 in 32..=1024",
            v.name, p.threads
        ));
    }
    params::in_range(v, "UNROLL", p.unroll, 1..=8)?;
    params::in_range(v, "MIN_BLOCKS", p.min_blocks, 1..=32)?;
    Ok(p)
}

/// The bits of `AdamStep::flags`, passed to kernels/adam.cu as `TF_ADAM_<NAME>`.
const FLAG_DECOUPLED: u32 = 1; // AdamW: weight decay applied to the param, not the gradient
const FLAG_AMSGRAD: u32 = 2;
const FLAG_MAXIMIZE: u32 = 4;

/// The kernels of kernels/adam.cu, by name: up to `MAX_TENSORS_PER_LAUNCH` tensors a launch,
/// and up to `SMALL_TENSORS_PER_LAUNCH` (a short list should not pay for copying 32 KB of
/// parameters at launch).
const STEP_KERNEL: &str = "adam_step";
const STEP_SMALL_KERNEL: &str = "adam_step_small";

/// `_fused_adam_` / `_fused_adamw_` (either lr overload): updates the params and moments in
/// place, no outputs.
pub struct Adam;

impl Family for Adam {
    type Call = TfAdamCall;

    const FAMILY: OpFamily = OpFamily::Adam;

    /// The params' dtype, and [tensors, elements].
    unsafe fn unreadable(_entry: Entry, call: &TfAdamCall) -> Option<&TfTensor> {
        let lists = call
            .lists
            .iter()
            .zip(call.lens)
            .filter(|(list, _)| !list.is_null());
        let listed = lists.flat_map(|(list, len)| std::slice::from_raw_parts(*list, len));
        let scalars = [&call.lr_tensor, &call.grad_scale, &call.found_inf];
        listed.chain(scalars).find(|t| t.symbolic != 0)
    }

    unsafe fn describe(_entry: Entry, call: &TfAdamCall) -> Option<(&'static str, Vec<i64>)> {
        Some(AdamCall::from_c(call).describe())
    }

    unsafe fn refuse(entry: Entry, call: &TfAdamCall) -> Option<String> {
        list_length_error(call, entry.aten_name())
    }

    unsafe fn serve(
        _entry: Entry,
        launch: Launch,
        call: &TfAdamCall,
        _shape: &[i64],
    ) -> Result<Served, StockReason> {
        let kernel = step(launch, &AdamCall::from_c(call))?;
        Ok(Served::new(kernel, [None, None, None]))
    }

    fn kernels(_op: KernelOp) -> &'static [&'static str] {
        &[STEP_KERNEL, STEP_SMALL_KERNEL]
    }

    /// Each kernel's one parameter, `args`: an `AdamArgs` of its capacity.
    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        const fn one_struct(size: usize) -> [Field; 1] {
            [Field {
                name: "args",
                offset: 0,
                size,
            }]
        }
        const STEP: [Field; 1] =
            one_struct(std::mem::size_of::<AdamArgs<MAX_TENSORS_PER_LAUNCH>>());
        const SMALL: [Field; 1] =
            one_struct(std::mem::size_of::<AdamArgs<SMALL_TENSORS_PER_LAUNCH>>());
        match kernel {
            STEP_KERNEL => Some(&STEP),
            STEP_SMALL_KERNEL => Some(&SMALL),
            _ => None,
        }
    }

    /// The constants kernels/adam.cu shares with this file.
    fn defines(_op: KernelOp) -> Vec<String> {
        vec![
            format!("-DTF_ADAM_MAX_TENSORS={MAX_TENSORS_PER_LAUNCH}"),
            format!("-DTF_ADAM_SMALL_TENSORS={SMALL_TENSORS_PER_LAUNCH}"),
            format!("-DTF_ADAM_DECOUPLED={FLAG_DECOUPLED}u"),
            format!("-DTF_ADAM_AMSGRAD={FLAG_AMSGRAD}u"),
            format!("-DTF_ADAM_MAXIMIZE={FLAG_MAXIMIZE}u"),
        ]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        prepare(v)
    }
}

/// `AdamTensor` in kernels/adam.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AdamTensor {
    param: u64,
    grad: u64,
    exp_avg: u64,
    exp_avg_sq: u64,
    max_exp_avg_sq: u64,
    step: u64,
    numel: i64,
    first_unit: u32,
    unused: u32,
}

/// `AdamArgs<CAPACITY>` in kernels/adam.cu: the kernel's only parameter.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamArgs<const CAPACITY: usize> {
    step: StepScalars,
    tensors: u32,
    units: u32,
    t: [AdamTensor; CAPACITY],
}

/// The capacity of `adam_step_small` (`TF_ADAM_SMALL_TENSORS`).
const SMALL_TENSORS_PER_LAUNCH: usize = 32;

const _: () = assert!(std::mem::size_of::<AdamTensor>() == 64);
const _: () = assert!(std::mem::size_of::<StepScalars>() == 48);
const _: () = assert!(
    std::mem::size_of::<AdamArgs<MAX_TENSORS_PER_LAUNCH>>() == 56 + 64 * MAX_TENSORS_PER_LAUNCH
);
const _: () = assert!(std::mem::size_of::<AdamArgs<MAX_TENSORS_PER_LAUNCH>>() <= 32764);
const _: () = assert!(
    std::mem::size_of::<AdamArgs<SMALL_TENSORS_PER_LAUNCH>>() == 56 + 64 * SMALL_TENSORS_PER_LAUNCH
);

// SAFETY: plain old data with the kernel's layout (checked above and by static_asserts in the
// kernel); passed by value as the kernel's parameter.
unsafe impl<const CAPACITY: usize> DeviceRepr for AdamArgs<CAPACITY> {}

/// What every launch of a step shares (`AdamStep` in kernels/adam.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct StepScalars {
    lr: f32,
    beta1: f32,
    beta2: f32,
    weight_decay: f32,
    eps: f32,
    flags: u32,
    lr_ptr: u64,
    grad_scale: u64,
    found_inf: u64,
}

impl<const CAPACITY: usize> AdamArgs<CAPACITY> {
    fn fill(&mut self, step: &StepScalars, batch: &[AdamTensor], units: u32) {
        self.step = *step;
        self.tensors = batch.len() as u32;
        self.units = units;
        self.t[..batch.len()].copy_from_slice(batch);
    }

    fn empty() -> Self {
        AdamArgs {
            step: StepScalars::default(),
            tensors: 0,
            units: 0,
            t: [AdamTensor::default(); CAPACITY],
        }
    }
}

thread_local! {
    /// The large launch's 32 KB of parameters, reused: the driver copies them at launch.
    static LARGE_ARGS: std::cell::RefCell<Box<AdamArgs<MAX_TENSORS_PER_LAUNCH>>> =
        std::cell::RefCell::new(Box::new(AdamArgs::empty()));
}

/// Same CUDA device as the params, and a 16-bit index that fits.
fn on_device(t: &TfTensor, device: i32) -> bool {
    t.device >= 0 && i32::from(t.device) == device
}

/// A one-element (at least) fp32 tensor on `device`: what stock reads through a `float*`.
fn float_scalar_on(t: &TfTensor, device: i32) -> bool {
    on_device(t, device) && t.dtype == SCALAR_FLOAT && t.numel >= 1 && !t.data.is_null()
}

/// The checks stock makes: every tensor of the moment lists like its param (same dtype,
/// device, sizes and strides, dense); steps, lr, grad_scale and found_inf fp32 on the device.
/// Whatever fails goes to stock, which raises its own error or does what it does.
fn check(call: &AdamCall, launch: Launch) -> Result<DType, StockReason> {
    let n = call.params.len();
    let first = call.params.first().ok_or(StockReason::EmptyInput)?;
    let dtype = dtype_from_scalar_type(first.dtype).ok_or(StockReason::UnsupportedDtype)?;
    let mut lists = vec![call.params, call.grads, call.exp_avgs, call.exp_avg_sqs];
    if call.c.amsgrad != 0 {
        lists.push(call.max_exp_avg_sqs);
    }
    if lists.iter().any(|l| l.len() != n) || call.steps.len() != n {
        return Err(StockReason::InvalidInput);
    }
    let device = launch.device;
    let like_first = |t: &TfTensor| {
        t.dtype == first.dtype && on_device(t, device) && t.dense == 1 && t.like_first == 1
    };
    if !lists.iter().all(|l| l.iter().all(like_first)) {
        return Err(StockReason::InvalidInput);
    }
    if !call.steps.iter().all(|s| float_scalar_on(s, device)) {
        return Err(StockReason::InvalidInput);
    }
    let scalars = [call.lr_tensor, call.grad_scale, call.found_inf];
    if !scalars.iter().flatten().all(|s| float_scalar_on(s, device)) {
        return Err(StockReason::InvalidInput);
    }
    if call.params.iter().all(|p| p.numel == 0) {
        return Err(StockReason::EmptyInput);
    }
    Ok(dtype)
}

/// Elements one warp handles per unit (`TF_UNIT` in the kernel).
fn unit_elements(p: &Params, dtype: DType) -> i64 {
    32 * dtype.vector_elems() * p.unroll
}

/// Runs the step with a fused kernel when the registry has one; Ok: the kernel's name.
fn step(launch: Launch, call: &AdamCall) -> Result<&'static str, StockReason> {
    let dtype = check(call, launch)?;
    let elements: i64 = call.params.iter().map(|p| p.numel).sum();
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = super::select(launch, |sm| Request {
        op: KernelOp::AdamStep,
        dtype,
        hidden: 1,
        rows: elements,
        sm,
        deterministic: false,
        narrowed: false,
    })?;
    let p = Adam::params(params)?;
    // `prepare` keeps it in 32..=1024.
    let threads = p.threads as u32;
    let warps_per_block = i64::from(threads / 32);
    let step_kernel = kernels.get(STEP_KERNEL)?;
    let small_kernel = kernels.get(STEP_SMALL_KERNEL)?;
    let resident = i64::from(step_kernel.resident_per_sm(threads)) * i64::from(gpu.multiprocessors);
    let unit = unit_elements(p, dtype);

    let c = call.c;
    let mut flags = 0;
    if c.decoupled != 0 {
        flags |= FLAG_DECOUPLED;
    }
    if c.amsgrad != 0 {
        flags |= FLAG_AMSGRAD;
    }
    if c.maximize != 0 {
        flags |= FLAG_MAXIMIZE;
    }
    let addr = |t: Option<&TfTensor>| t.map_or(0, |t| t.data as u64);
    let scalars = StepScalars {
        // Stock casts every hyperparameter to fp32 (its math type) the same way.
        lr: c.lr as f32,
        beta1: c.beta1 as f32,
        beta2: c.beta2 as f32,
        weight_decay: c.weight_decay as f32,
        eps: c.eps as f32,
        flags,
        lr_ptr: addr(call.lr_tensor),
        grad_scale: addr(call.grad_scale),
        found_inf: addr(call.found_inf),
    };

    let (tensors, batches) = plan_launches(call, unit)?;

    let stream = gpu.stream(launch);
    for (launched, (range, units)) in batches.into_iter().enumerate() {
        let batch = &tensors[range];
        let blocks = crate::gpu::ceil_div(i64::from(units), warps_per_block);
        let config = LaunchConfig {
            grid_dim: (blocks.min(resident).max(1) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let result = if batch.len() <= SMALL_TENSORS_PER_LAUNCH {
            let mut args = AdamArgs::<SMALL_TENSORS_PER_LAUNCH>::empty();
            args.fill(&scalars, batch, units);
            let mut builder = stream.launch_builder(&small_kernel.function);
            builder.arg(&args);
            // SAFETY: the argument matches the kernel's signature; every pointer is a live
            // tensor of this call on this device (checked), ordered on PyTorch's stream.
            unsafe { builder.launch(config) }
        } else {
            LARGE_ARGS.with_borrow_mut(|args| {
                args.fill(&scalars, batch, units);
                let mut builder = stream.launch_builder(&step_kernel.function);
                builder.arg(&**args);
                // SAFETY: as above; the driver copies the parameters during the call.
                unsafe { builder.launch(config) }
            })
        };
        let result = result
            .map(|_| ())
            .map_err(|e| super::launch_failed(variant, e));
        launch_or_explain(result, launched)?;
    }
    Ok(&variant.name)
}
/// A launch: a range of the step's tensors and the work units they hold.
type Batch = (std::ops::Range<usize>, u32);

/// The step's non-empty tensors as the kernel sees them, cut into launches of at most
/// MAX_TENSORS_PER_LAUNCH tensors whose units (of `unit` elements) fit in u32; each tensor's
/// `first_unit` counts from the start of its launch.
fn plan_launches(call: &AdamCall, unit: i64) -> Result<(Vec<AdamTensor>, Vec<Batch>), StockReason> {
    let mut tensors: Vec<AdamTensor> = Vec::with_capacity(call.params.len());
    let mut batches: Vec<Batch> = Vec::new();
    let (mut batch_start, mut units_so_far) = (0usize, 0u32);
    for i in 0..call.params.len() {
        let numel = call.params[i].numel;
        if numel == 0 {
            continue;
        }
        let units = crate::gpu::grid_dim(numel, unit)?;
        let full = tensors.len() - batch_start == MAX_TENSORS_PER_LAUNCH;
        if full || units_so_far.checked_add(units).is_none() {
            batches.push((batch_start..tensors.len(), units_so_far));
            (batch_start, units_so_far) = (tensors.len(), 0);
        }
        tensors.push(AdamTensor {
            param: call.params[i].data as u64,
            grad: call.grads[i].data as u64,
            exp_avg: call.exp_avgs[i].data as u64,
            exp_avg_sq: call.exp_avg_sqs[i].data as u64,
            max_exp_avg_sq: if call.c.amsgrad != 0 {
                call.max_exp_avg_sqs[i].data as u64
            } else {
                0
            },
            step: call.steps[i].data as u64,
            numel,
            first_unit: units_so_far,
            unused: 0,
        });
        units_so_far += units;
    }
    batches.push((batch_start..tensors.len(), units_so_far));
    Ok((tensors, batches))
}

/// The first launch of a step may fail over to stock. A later one must not: stock would apply
/// the earlier batches' update a second time. The same kernel and launch shape that just
/// launched can only fail now if the CUDA context is broken, which PyTorch's next CUDA call
/// reports anyway, so the failure is logged as an error and the call counts as served.
fn launch_or_explain(result: Result<(), StockReason>, earlier: usize) -> Result<(), StockReason> {
    match result {
        Err(reason) if earlier == 0 => Err(reason),
        Err(reason) => {
            tracing::error!(
                "Adam step: launch {} of the step failed ({reason}) after {earlier} launches ran; \
                 the remaining tensors were not updated (the CUDA context is likely broken)",
                earlier + 1
            );
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn absent() -> TfTensor {
        TfTensor::ABSENT
    }

    /// A present tensor (the handle only needs to be non-null: these tests read facts only).
    fn facts(numel: i64, dtype: i16, device: i16, addr: usize) -> TfTensor {
        TfTensor {
            handle: std::ptr::NonNull::<u8>::dangling().as_ptr().cast(),
            data: addr as *mut std::ffi::c_void,
            numel,
            dtype,
            device,
            dense: 1,
            like_first: 1,
            ..TfTensor::ABSENT
        }
    }

    /// Owns the fact lists a test call borrows.
    struct Lists {
        lists: [Vec<TfTensor>; 6],
        c: TfAdamCall,
    }

    impl Lists {
        fn new(numels: &[i64], dtype: i16) -> Lists {
            let list = |base: usize| -> Vec<TfTensor> {
                numels
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| facts(n, dtype, 0, base + i * 4096))
                    .collect()
            };
            let steps = numels
                .iter()
                .enumerate()
                .map(|(i, _)| facts(1, SCALAR_FLOAT, 0, 0x9000_0000 + i * 16))
                .collect();
            Lists {
                lists: [
                    list(0x1000_0000),
                    list(0x2000_0000),
                    list(0x3000_0000),
                    list(0x4000_0000),
                    list(0x5000_0000),
                    steps,
                ],
                c: TfAdamCall {
                    lists: [std::ptr::null(); 6],
                    lens: [0; 6],
                    lr_tensor: absent(),
                    grad_scale: absent(),
                    found_inf: absent(),
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    weight_decay: 0.0,
                    eps: 1e-8,
                    decoupled: 1,
                    amsgrad: 0,
                    maximize: 0,
                    unused: [0; 5],
                },
            }
        }

        fn call(&mut self) -> AdamCall<'_> {
            for i in 0..6 {
                self.c.lists[i] = self.lists[i].as_ptr();
                self.c.lens[i] = self.lists[i].len();
            }
            // SAFETY: the lists live as long as self, and lens match.
            unsafe { AdamCall::from_c(&self.c) }
        }
    }

    const CUDA0: Launch = Launch {
        device: 0,
        stream: std::ptr::null_mut(),
    };

    #[test]
    fn a_symbolic_tensor_anywhere_in_the_call_is_found() {
        let mut lists = Lists::new(&[10, 3], SCALAR_FLOAT);
        lists.call();
        // SAFETY: the call's lists point into `lists`, alive here.
        assert!(unsafe { <Adam as Family>::unreadable(Entry::FusedAdamw, &lists.c) }.is_none());
        lists.lists[3][1].symbolic = 1;
        lists.call();
        let found = unsafe { <Adam as Family>::unreadable(Entry::FusedAdamw, &lists.c) };
        assert_eq!(found.map(|t| t.numel), Some(3));
        lists.lists[3][1].symbolic = 0;
        lists.c.found_inf.symbolic = 1;
        lists.call();
        assert!(unsafe { <Adam as Family>::unreadable(Entry::FusedAdamw, &lists.c) }.is_some());
    }

    #[test]
    fn checks_send_what_stock_rejects_or_serves_differently_to_stock() {
        let mut ok = Lists::new(&[10, 0, 3], SCALAR_FLOAT);
        assert_eq!(check(&ok.call(), CUDA0), Ok(DType::F32));
        let mut bf16 = Lists::new(&[10], SCALAR_BFLOAT16);
        assert_eq!(check(&bf16.call(), CUDA0), Ok(DType::BF16));
        let mut f64s = Lists::new(&[10], SCALAR_DOUBLE);
        assert_eq!(
            check(&f64s.call(), CUDA0),
            Err(StockReason::UnsupportedDtype)
        );
        let mut empty = Lists::new(&[], SCALAR_FLOAT);
        assert_eq!(check(&empty.call(), CUDA0), Err(StockReason::EmptyInput));
        let mut all_zero = Lists::new(&[0, 0], SCALAR_FLOAT);
        assert_eq!(check(&all_zero.call(), CUDA0), Err(StockReason::EmptyInput));

        type Spoil = fn(&mut Lists);
        let spoilers: [(&str, Spoil); 7] = [
            ("moment of another dtype", |l| {
                l.lists[2][1].dtype = SCALAR_BFLOAT16
            }),
            ("grad on the CPU", |l| l.lists[1][0].device = -1),
            ("param on another GPU", |l| l.lists[0][2].device = 1),
            ("strided moment", |l| l.lists[3][0].dense = 0),
            ("grad of another shape", |l| l.lists[1][2].like_first = 0),
            ("f64 step count", |l| l.lists[5][0].dtype = SCALAR_DOUBLE),
            ("step count on the CPU", |l| l.lists[5][1].device = -1),
        ];
        for (what, spoil) in spoilers {
            let mut l = Lists::new(&[10, 7, 3], SCALAR_FLOAT);
            spoil(&mut l);
            assert_eq!(
                check(&l.call(), CUDA0),
                Err(StockReason::InvalidInput),
                "{what}"
            );
        }
        // max_exp_avg_sqs counts only under amsgrad.
        let mut l = Lists::new(&[10, 7], SCALAR_FLOAT);
        l.lists[4][0].dtype = SCALAR_HALF;
        assert_eq!(check(&l.call(), CUDA0), Ok(DType::F32));
        l.c.amsgrad = 1;
        assert_eq!(check(&l.call(), CUDA0), Err(StockReason::InvalidInput));
        // GradScaler's tensors and a device lr: fp32 on the params' device.
        let mut l = Lists::new(&[10], SCALAR_FLOAT);
        let scale = facts(1, SCALAR_DOUBLE, 0, 0x7000_0000);
        l.c.grad_scale = scale;
        assert_eq!(check(&l.call(), CUDA0), Err(StockReason::InvalidInput));
        let lr = facts(1, SCALAR_FLOAT, 0, 0x7100_0000);
        l.c.grad_scale = absent();
        l.c.lr_tensor = lr;
        assert_eq!(check(&l.call(), CUDA0), Ok(DType::F32));
    }

    #[test]
    fn lists_of_different_lengths_are_refused() {
        let mut l = Lists::new(&[10, 7, 3], SCALAR_FLOAT);
        l.lists[3].pop();
        let _ = l.call();
        let msg = list_length_error(&l.c, "_fused_adamw_").expect("an error");
        assert!(msg.contains("got 3, 3, 3, 2, 3"), "{msg}");
        // Without amsgrad, max_exp_avg_sqs is not read: its length does not matter.
        let mut l = Lists::new(&[10, 7, 3], SCALAR_FLOAT);
        l.lists[4].clear();
        let _ = l.call();
        assert_eq!(list_length_error(&l.c, "_fused_adam_"), None);
        l.c.amsgrad = 1;
        assert!(list_length_error(&l.c, "_fused_adam_").is_some());
    }

    #[test]
    fn launches_hold_at_most_their_capacity_and_count_units_from_their_start() {
        let numels: Vec<i64> = (0..1234)
            .map(|i| if i % 100 == 7 { 0 } else { 1 + i * 3 })
            .collect();
        let mut l = Lists::new(&numels, SCALAR_FLOAT);
        let unit = 256;
        let (tensors, batches) = plan_launches(&l.call(), unit).expect("plan");
        let non_empty = numels.iter().filter(|&&n| n > 0).count();
        assert_eq!(tensors.len(), non_empty);
        assert_eq!(batches.len(), non_empty.div_ceil(MAX_TENSORS_PER_LAUNCH));
        let mut covered = 0;
        for (range, units) in &batches {
            assert!(range.len() <= MAX_TENSORS_PER_LAUNCH);
            assert_eq!(range.start, covered);
            covered = range.end;
            let mut next = 0u32;
            for t in &tensors[range.clone()] {
                assert_eq!(t.first_unit, next);
                next += crate::gpu::ceil_div(t.numel, unit) as u32;
            }
            assert_eq!(next, *units);
        }
        assert_eq!(covered, tensors.len());
        // A tensor too large for 32-bit unit counts goes to stock.
        let mut huge = Lists::new(&[1 << 45], SCALAR_FLOAT);
        assert_eq!(
            plan_launches(&huge.call(), 32).err(),
            Some(StockReason::NoVariantForShape)
        );
    }
}
