//! scaled_dot_product_attention through kernels/attention.cu: the backend choice (we answer
//! "flash" for the calls our registry takes) and the flash backend's forward and backward.
//!
//! `plan` is the one decision: a pure function of the call (shapes, dtype, flags, strides) and
//! the registry, so the backend choice, the forward and the backward always agree. Its outputs
//! have stock flash's formats (output [B, H, Lq, D] as a transposed [B, Lq, H, D] tensor, fp32
//! logsumexp [B, H, Lq] in natural log), so a forward of ours and a backward of stock's (or the
//! reverse, after a fallback) still fit together.

use super::params::{self, flag, one};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, device_addr, empty};
use crate::abi::types::{TfAttentionCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, DType, StockReason};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Strides (elements) of a [B, H, L, D] operand for the kernels (`Strides` in attention.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Strides {
    batch: i64,
    head: i64,
    row: i64,
}

// SAFETY: plain old data, laid out as the kernel's struct.
unsafe impl DeviceRepr for Strides {}

/// The call's sizes and softmax constants (`Problem` in attention.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Problem {
    heads: i32,
    lq: i32,
    lk: i32,
    /// Query heads per kv head.
    group: i32,
    /// scale * log2(e): the kernels' softmax is base 2.
    scale_log2: f32,
    scale: f32,
    causal: i32,
    batch: i32,
}

// SAFETY: plain old data, laid out as the kernel's struct.
unsafe impl DeviceRepr for Problem {}

impl Strides {
    /// Of a [B, H, L, D] tensor's strides.
    fn of(s: &[i64]) -> Strides {
        Strides {
            batch: s[0],
            head: s[1],
            row: s[2],
        }
    }
}

/// The fewest rows (queries or keys) of any kernel's tile: 16 * M_TILES * WARPS at its least.
const MIN_TILE_ROWS: i64 = 32;

/// An attention variant's compile-time params (`registry/attention.toml`): its kernels'
/// launch shapes, checked once. HEAD_DIM is required; the rest default as written.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    head_dim: i64,
    #[serde(default = "four")]
    fwd_warps: i64,
    #[serde(default = "sixty_four")]
    fwd_block_n: i64,
    #[serde(default = "four")]
    bwd_warps: i64,
    #[serde(default = "sixty_four")]
    bwd_block_q: i64,
    #[serde(default = "sixty_four")]
    dq_block_n: i64,
    #[serde(default = "one")]
    fwd_m_tiles: i64,
    #[serde(default = "one")]
    bwd_m_tiles: i64,
    /// CTAs per SM the register allocation must allow (`__launch_bounds__`).
    #[serde(default = "one")]
    fwd_min_blocks: i64,
    #[serde(default = "one")]
    bwd_min_blocks: i64,
    /// The forward is the warpgroup-MMA kernel (sm_90a).
    #[serde(default, with = "flag")]
    fwd_wgmma: bool,
    /// K/V stages of the warpgroup forward's ring (the mma.sync forward double-buffers).
    #[serde(default = "two")]
    fwd_stages: i64,
    /// The warpgroup forward's loads are TMA copies issued by one more (producer) warpgroup.
    #[serde(default, with = "flag")]
    fwd_tma: bool,
    /// The warpgroup forward's two computing warpgroups take turns issuing their gemms.
    #[serde(default, with = "flag")]
    fwd_pingpong: bool,
    /// attn_bwd_dkdv and attn_bwd_dq are the warpgroup-MMA kernels fed by TMA (128 keys or
    /// query rows a CTA, 3 warpgroups).
    #[serde(default, with = "flag")]
    bwd_wgmma: bool,
    /// The TMA forward is persistent: a CTA per SM takes tiles from a counter, Q
    /// double-buffered and each tile's output staged in its Q buffer.
    #[serde(default, with = "flag")]
    fwd_persistent: bool,
}

fn two() -> i64 {
    2
}
fn four() -> i64 {
    4
}
fn sixty_four() -> i64 {
    64
}

/// A variant's launch shapes: its params.
type Shapes = Params;

/// The values each numeric param may take (`prepare` lists the params in this order).
const ALLOWED: [(&str, &[i64]); 11] = [
    ("HEAD_DIM", &[64, 128]),
    ("FWD_WARPS", &[2, 4, 8, 12]),
    ("FWD_BLOCK_N", &[32, 64, 128]),
    ("BWD_WARPS", &[2, 4, 8]),
    ("BWD_BLOCK_Q", &[16, 32, 64, 128]),
    ("DQ_BLOCK_N", &[16, 32, 64, 128]),
    ("FWD_M_TILES", &[1, 2]),
    ("BWD_M_TILES", &[1, 2]),
    ("FWD_MIN_BLOCKS", &[1, 2, 3, 4]),
    ("BWD_MIN_BLOCKS", &[1, 2, 3, 4]),
    ("FWD_STAGES", &[2, 3, 4]),
];

/// An attention variant's params, and their limits.
fn prepare(v: &Variant) -> Result<Params, String> {
    let shapes: Params = params::parse(v)?;
    let values = [
        shapes.head_dim,
        shapes.fwd_warps,
        shapes.fwd_block_n,
        shapes.bwd_warps,
        shapes.bwd_block_q,
        shapes.dq_block_n,
        shapes.fwd_m_tiles,
        shapes.bwd_m_tiles,
        shapes.fwd_min_blocks,
        shapes.bwd_min_blocks,
        shapes.fwd_stages,
    ];
    for ((name, allowed), value) in ALLOWED.into_iter().zip(values) {
        params::one_of(v, name, value, allowed)?;
    }
    let head_dim = shapes.head_dim;
    if v.hidden != [head_dim, head_dim] {
        return Err(format!(
            "{}: hidden must be [{head_dim}, {head_dim}] (the head dim)",
            v.name
        ));
    }
    if v.dtypes.contains(&DType::F32) {
        return Err(format!("{}: attention kernels are bf16/f16 only", v.name));
    }
    if v.sm[0] < 80 {
        return Err(format!("{}: mma.sync bf16 needs sm_80 or newer", v.name));
    }
    if shapes.fwd_wgmma {
        // wgmma is an sm_90a feature: arch-specific, so no other SM runs it.
        if v.sm != [90, 90] {
            return Err(format!("{}: FWD_WGMMA needs sm = [90, 90]", v.name));
        }
        // The output is staged through the K tiles: 16 rows per warp must fit in them.
        if shapes.fwd_m_tiles != 1
            || shapes.fwd_warps % 4 != 0
            || shapes.fwd_block_n < 64
            || 16 * shapes.fwd_warps > shapes.fwd_stages * shapes.fwd_block_n
        {
            return Err(format!(
                "{}: FWD_WGMMA takes FWD_WARPS 4, 8 or 12, FWD_M_TILES 1, FWD_BLOCK_N 64 or 128 \
                 (and 16 * FWD_WARPS <= FWD_STAGES * FWD_BLOCK_N)",
                v.name
            ));
        }
        // Three computing warpgroups fit in the registers only with the producer's given up.
        if shapes.fwd_warps == 12 && !shapes.fwd_tma {
            return Err(format!("{}: FWD_WARPS 12 takes FWD_TMA = 1", v.name));
        }
        if shapes.fwd_persistent && !shapes.fwd_tma {
            return Err(format!("{}: FWD_PERSISTENT takes FWD_TMA = 1", v.name));
        }
        if shapes.fwd_pingpong && !(shapes.fwd_tma && shapes.fwd_warps == 8) {
            return Err(format!(
                "{}: FWD_PINGPONG takes FWD_TMA = 1 and FWD_WARPS = 8",
                v.name
            ));
        }
        if shapes.bwd_wgmma
            && !(shapes.fwd_tma && shapes.bwd_block_q == 64 && shapes.dq_block_n == 64)
        {
            return Err(format!(
                "{}: BWD_WGMMA takes FWD_TMA = 1, BWD_BLOCK_Q = 64 and DQ_BLOCK_N = 64",
                v.name
            ));
        }
        if shapes.fwd_tma && shapes.fwd_min_blocks != 1 {
            return Err(format!(
                "{}: FWD_TMA takes FWD_MIN_BLOCKS 1 (its consumers take the producer's registers)",
                v.name
            ));
        }
    } else if shapes.fwd_warps == 12 {
        return Err(format!(
            "{}: FWD_WARPS 12 is the warpgroup forward's (FWD_WGMMA = 1, FWD_TMA = 1)",
            v.name
        ));
    } else if shapes.fwd_tma || shapes.fwd_pingpong || shapes.bwd_wgmma {
        return Err(format!(
            "{}: FWD_TMA, FWD_PINGPONG and BWD_WGMMA need FWD_WGMMA = 1",
            v.name
        ));
    } else if shapes.fwd_stages != 2 {
        return Err(format!(
            "{}: FWD_STAGES is the warpgroup forward's (FWD_WGMMA = 1)",
            v.name
        ));
    }
    Ok(shapes)
}

impl Shapes {
    /// Threads of a forward CTA: the computing warps, and the producer warpgroup with TMA.
    fn fwd_threads(&self) -> i64 {
        32 * self.fwd_warps + if self.fwd_tma { 128 } else { 0 }
    }
    /// Query rows of a forward CTA.
    fn fwd_block_m(&self) -> i64 {
        16 * self.fwd_m_tiles * self.fwd_warps
    }
    /// Keys of a dK/dV CTA, query rows of a dQ CTA.
    fn bwd_rows(&self) -> i64 {
        16 * self.bwd_m_tiles * self.bwd_warps
    }
    /// Dynamic shared memory of each kernel, as attention.cu lays it out.
    fn fwd_smem(&self) -> u32 {
        // The warpgroup kernel's tiles start on a 1024-byte boundary: slack to align them.
        let align = if self.fwd_wgmma { 1024 } else { 0 };
        // TMA: after the tiles, one mbarrier for Q and four per stage; persistent: two Q
        // buffers with a full and an empty mbarrier and a tile number (8 bytes) each.
        let (q_tiles, q_barriers) = if self.fwd_persistent {
            (2, 4 + 2)
        } else {
            (1, 1)
        };
        let barriers = if self.fwd_tma {
            8 * (q_barriers + 4 * self.fwd_stages)
        } else {
            0
        };
        ((q_tiles * self.fwd_block_m() + 2 * self.fwd_stages * self.fwd_block_n)
            * self.head_dim
            * 2
            + align
            + barriers) as u32
    }
    fn dkdv_smem(&self) -> u32 {
        if self.bwd_wgmma {
            // K and V tiles, 2 stages of Q, dO, logsumexp and delta, 5 mbarriers, and slack to
            // align the tiles to 1024 bytes.
            return ((2 * DKDV_WG_KEYS + 4 * self.bwd_block_q) * self.head_dim * 2
                + 4 * self.bwd_block_q * 4
                + 8 * 5
                + 1024) as u32;
        }
        ((2 * self.bwd_rows() + 4 * self.bwd_block_q) * self.head_dim * 2
            + 4 * self.bwd_block_q * 4) as u32
    }
    /// Keys of a dK/dV CTA.
    fn dkdv_keys(&self) -> i64 {
        if self.bwd_wgmma {
            DKDV_WG_KEYS
        } else {
            self.bwd_rows()
        }
    }
    /// Threads of a dK/dV or dQ CTA.
    fn bwd_threads(&self) -> i64 {
        if self.bwd_wgmma {
            384
        } else {
            32 * self.bwd_warps
        }
    }
    fn dq_smem(&self) -> u32 {
        if self.bwd_wgmma {
            // Q and dO tiles, 2 stages of K and V, 5 mbarriers, and the alignment slack.
            return ((2 * DQ_WG_ROWS + 4 * self.dq_block_n) * self.head_dim * 2 + 8 * 5 + 1024)
                as u32;
        }
        ((2 * self.bwd_rows() + 4 * self.dq_block_n) * self.head_dim * 2) as u32
    }
    /// Query rows of a dQ CTA.
    fn dq_rows(&self) -> i64 {
        if self.bwd_wgmma {
            DQ_WG_ROWS
        } else {
            self.bwd_rows()
        }
    }
}

kernel_args! {
    /// attn_bwd_prep's arguments (kernels/attention.cu): delta = rowsum(dO * O), `rows` of
    /// them (B * H * Lq).
    struct PrepArgs {
        o: u64,
        os: Strides,
        dout: u64,
        ds: Strides,
        delta: u64,
        heads: i32,
        lq: i32,
        rows: i64,
    }
}

/// The arguments attn_bwd_dkdv and attn_bwd_dq both take first: q, k, v, dO (pointers and
/// strides), then the logsumexp and delta.
struct BackwardInputs {
    q: u64,
    qs: Strides,
    k: u64,
    ks: Strides,
    v: u64,
    vs: Strides,
    dout: u64,
    dos: Strides,
    lse: u64,
    delta: u64,
}

impl BackwardInputs {
    fn push<'a>(&'a self, args: &mut cudarc::driver::LaunchArgs<'a>) {
        args.arg(&self.q)
            .arg(&self.qs)
            .arg(&self.k)
            .arg(&self.ks)
            .arg(&self.v)
            .arg(&self.vs)
            .arg(&self.dout)
            .arg(&self.dos)
            .arg(&self.lse)
            .arg(&self.delta);
    }
}

/// Keys of the warpgroup dK/dV kernel's CTA, and query rows of the warpgroup dQ kernel's CTA:
/// shared with kernels/attention.cu (`defines`).
const DKDV_WG_KEYS: i64 = 128;
const DQ_WG_ROWS: i64 = 128;

/// The kernels of kernels/attention.cu, by name: the forward; the backward's row sums of
/// dO * O (delta), dK/dV, and dQ.
const FWD: &str = "attn_fwd";
const PREP: &str = "attn_bwd_prep";
const DKDV: &str = "attn_bwd_dkdv";
const DQ: &str = "attn_bwd_dq";

/// scaled_dot_product_attention through the flash backend: the backend choice (flash when
/// torchfuse serves the call), `_scaled_dot_product_flash_attention` (out: output,
/// logsumexp) and its backward (out: dq, dk, dv). One `plan` decides all three.
pub struct Attention;

impl Family for Attention {
    type Call = TfAttentionCall;

    const FAMILY: OpFamily = OpFamily::Attention;

    /// q's dtype and shape.
    unsafe fn unreadable(entry: Entry, call: &TfAttentionCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(
            &[
                &call.query,
                &call.key,
                &call.value,
                &call.grad_out,
                &call.output,
                &call.logsumexp,
            ],
            entry != Entry::SdpChoice,
        )
    }

    unsafe fn describe(_entry: Entry, call: &TfAttentionCall) -> Option<(&'static str, Vec<i64>)> {
        Some(crate::abi::tensor::describe(call.query.given()?))
    }

    /// q and k whose last dims differ: no backend can compute q k^T, yet stock's choice can
    /// pick cuDNN, whose graph for them fails on the first call and crashes the process on the
    /// next (torch 2.11, an H200). Refused at the choice with the reason in words, every time.
    unsafe fn refuse(entry: Entry, call: &TfAttentionCall) -> Option<String> {
        if entry != Entry::SdpChoice || call.nested != 0 {
            return None;
        }
        let (q, k) = (call.query.given()?, call.key.given()?);
        let (q_dim, k_dim) = (*q.sizes().last()?, *k.sizes().last()?);
        (q_dim != k_dim).then(|| {
            format!(
                "scaled_dot_product_attention: query's last dimension ({q_dim}) must equal \
                 key's ({k_dim})"
            )
        })
    }

    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfAttentionCall,
        _shape: &[i64],
    ) -> Result<Served, StockReason> {
        // Only a fused backend of stock's (1 flash, 2 efficient, 3 cuDNN) is replaced: an
        // error (-1) or a math fallback (0) stays stock's.
        if entry == Entry::SdpChoice && !(1..=3).contains(&call.stock_choice) {
            return Err(StockReason::AttentionFeature);
        }
        let plan = plan(launch, call)?;
        let outputs = match entry {
            Entry::FlashAttention => {
                let (output, lse) = plan.forward(launch, call)?;
                [Some(output), Some(lse), None]
            }
            Entry::FlashAttentionBackward => plan.backward(launch, call)?.map(Some),
            _ => [None, None, None],
        };
        Ok(Served::new(plan.kernel(), outputs))
    }

    fn kernels(_op: KernelOp) -> &'static [&'static str] {
        &[FWD, PREP, DKDV, DQ]
    }

    /// attn_bwd_prep's struct. The forward and the dK/dV and dQ kernels keep positional
    /// arguments (`BackwardInputs::push` and the launches): their parameter lists differ by
    /// variant (the sm_80 and sm_90 kernels; the TMA maps of some), which one struct per
    /// kernel name does not describe.
    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        (kernel == PREP).then_some(PrepArgs::FIELDS)
    }

    /// The constants kernels/attention.cu shares with this file.
    fn defines(_op: KernelOp) -> Vec<String> {
        vec![
            format!("-DTF_ATTN_DKDV_WG_KEYS={DKDV_WG_KEYS}"),
            format!("-DTF_ATTN_DQ_WG_ROWS={DQ_WG_ROWS}"),
        ]
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        prepare(v)
    }
}

/// A call torchfuse serves, with everything the launches need.
struct Plan {
    selected: Selected,
    shapes: Shapes,
    kind: Kind,
    device: Device,
    batch: i64,
    heads: i64,
    kv_heads: i64,
    lq: i64,
    lk: i64,
    scale: f64,
    causal: bool,
}

impl Plan {
    fn kernel(&self) -> &'static str {
        self.selected.variant.name.as_str()
    }
}

/// The call's q, k, v.
fn operands(call: &TfAttentionCall) -> Option<(&TfTensor, &TfTensor, &TfTensor)> {
    Some((call.query.given()?, call.key.given()?, call.value.given()?))
}

/// Last dimension contiguous, 16-byte aligned rows, and a 16-byte aligned start.
fn kernel_layout(t: &TfTensor) -> bool {
    let s = t.strides();
    s.len() == 4 && s[3] == 1 && s[..3].iter().all(|x| x % 8 == 0) && aligned16([t.addr()])
}

/// Whether torchfuse serves this call, and how: the one decision behind the backend choice,
/// the forward and the backward.
///
/// # Safety
/// As `operands`.
unsafe fn plan(launch: Launch, call: &TfAttentionCall) -> Result<Plan, StockReason> {
    if call.default_backends == 0 {
        return Err(StockReason::UserBackendChoice);
    }
    if call.has_mask != 0
        || call.dropout_p != 0.0
        || call.return_debug_mask != 0
        || call.nested != 0
    {
        return Err(StockReason::AttentionFeature);
    }
    let (q, k, v) = operands(call).ok_or(StockReason::InvalidInput)?;
    let kind = q.kind().ok_or(StockReason::UnsupportedDtype)?;
    let dtype = match dtype_of(kind) {
        Some(d @ (DType::BF16 | DType::F16)) => d,
        _ => return Err(StockReason::UnsupportedDtype),
    };
    if k.kind() != Some(kind) || v.kind() != Some(kind) {
        return Err(StockReason::MixedDtypes);
    }
    let device = gpu::torch_device(launch)?;
    if [q, k, v].iter().any(|t| t.device() != device) {
        return Err(StockReason::InvalidInput);
    }
    let ([b, h, lq, d], [bk, hk, lk, dk], [bv, hv, lv, dv]) = (q.sizes(), k.sizes(), v.sizes())
    else {
        return Err(StockReason::NoVariantForShape);
    };
    if bk != b || bv != b || hv != hk || lv != lk || dk != d || dv != d {
        return Err(StockReason::InvalidInput);
    }
    if [*b, *h, *hk, *lq, *lk, *d].contains(&0) {
        return Err(StockReason::EmptyInput);
    }
    if h % hk != 0 {
        return Err(StockReason::InvalidInput);
    }
    // Top-left causal masks are only the flash backend's when the lengths agree.
    let causal = call.is_causal != 0;
    if causal && lq != lk {
        return Err(StockReason::NoVariantForShape);
    }
    // Grid dimensions and 32-bit row indices in the kernels. A causal grid has its tiles in
    // its third dimension (at most 65535), tiles of at least MIN_TILE_ROWS rows.
    let max_len = if causal {
        65_535 * MIN_TILE_ROWS
    } else {
        i64::from(i32::MAX) / 2
    };
    if *b > 65_535 || *h > 65_535 || *lq > max_len || *lk > max_len {
        return Err(StockReason::NoVariantForShape);
    }
    if ![q, k, v].iter().all(|t| kernel_layout(t)) {
        return Err(StockReason::NoVariantForShape);
    }
    let scale = if call.has_scale != 0 {
        call.scale
    } else {
        1.0 / (*d as f64).sqrt()
    };
    if !scale.is_finite() {
        return Err(StockReason::InvalidInput);
    }
    // The warpgroup forward takes the max of the raw scores and puts the scale in the
    // exponent (attn_fwd), which holds for scales of at least 0 only.
    if scale < 0.0 {
        return Err(StockReason::AttentionFeature);
    }
    let op = if causal {
        KernelOp::AttentionCausal
    } else {
        KernelOp::AttentionFull
    };
    let selected = super::select(launch, |sm| Request {
        op,
        dtype,
        hidden: *d,
        rows: score_elements(*b, *h, *lq, *lk),
        sm,
        deterministic: call.deterministic != 0,
        narrowed: false,
    })?;
    let shapes = *Attention::params(selected.params)?;
    Ok(Plan {
        selected,
        shapes,
        kind,
        device,
        batch: *b,
        heads: *h,
        kv_heads: *hk,
        lq: *lq,
        lk: *lk,
        scale,
        causal,
    })
}

/// The registry's size of an attention call: B * H * Lq * Lk, the elements of the score
/// matrices (the work, whatever the batch/length split), saturating.
pub fn score_elements(batch: i64, heads: i64, lq: i64, lk: i64) -> i64 {
    batch
        .saturating_mul(heads)
        .saturating_mul(lq)
        .saturating_mul(lk)
}

fn dim_u32(n: i64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A CUtensorMap (`TmaMap` in attention.cu), passed by value to the kernel.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaMap([u64; 16]);

// SAFETY: plain old data, 128 bytes aligned to 64, as the kernel's parameter.
unsafe impl DeviceRepr for TmaMap {}

/// The tensor map of a [B, H, L, D] operand (rows 16-byte aligned, D contiguous) for boxes of
/// 64 columns x `box_rows` rows of one (batch, head), with the 128-byte swizzle the warpgroup
/// kernels' tiles use. Rows past L read as zeros.
fn tma_map(t: &TfTensor, kind: Kind, box_rows: u32) -> Result<TmaMap, StockReason> {
    use cudarc::driver::sys;
    let (size, stride) = (t.sizes(), t.strides());
    let element = if kind == Kind::BFloat16 {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    };
    let dims = [size[3], size[2], size[1], size[0]].map(|d| d as u64);
    let strides = [stride[2], stride[1], stride[0]].map(|s| (s * 2) as u64);
    let boxes = [64u32, box_rows, 1, 1];
    let element_strides = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: the arrays have the rank's lengths (4, and 3 strides); the address is the
    // tensor's, which outlives the launch the map is for.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            element,
            4,
            t.addr() as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        // The call then goes to stock's flash forward (logged with its reason).
        tracing::debug!(
            "attention: cannot describe {size:?} (strides {stride:?}) to TMA: {result:?}"
        );
        return Err(StockReason::NoVariantForShape);
    }
    // SAFETY: initialised by the successful call above.
    let map = unsafe { map.assume_init() };
    Ok(TmaMap(map.opaque))
}

/// A new [B, H, L, D] tensor laid out as stock's flash lays out the output (or gradient) made
/// from `like` (q for the output and dq, k for dk, v for dv): the flash kernels allocate it
/// with `empty_like` of the [B, L, H, D] view, so a dense `like` gives its own strides (a
/// contiguous [B, H, L, D] q, a contiguous output), anything else [B, L, H, D] storage.
fn empty_like_flash(like: &TfTensor, kind: Kind, device: Device) -> Result<Tensor, StockReason> {
    let size = like.sizes();
    let [b, h, l, d] = *size else {
        return Err(StockReason::InvalidInput);
    };
    if like.dense != 0 {
        return empty(&[like.numel()], kind, device)?
            .f_as_strided(size, like.strides(), 0)
            .map_err(|_| StockReason::InternalError);
    }
    Ok(empty(&[b, l, h, d], kind, device)?.transpose(1, 2))
}

impl Plan {
    /// The grid of a tiled kernel, in the order `grid_tile` in attention.cu reads: (heads,
    /// batch, tiles) with a causal mask, so every head's heaviest tiles are scheduled before
    /// any light one (same run, graph replay: GPT-2's forward 70.5 -> 65.8 us, S8192 D128
    /// forward+backward 2219 -> 1958 us); (tiles, heads, batch) without, so one head's CTAs
    /// share its K and V in L2.
    fn grid(&self, tiles: u32, heads: i64) -> (u32, u32, u32) {
        if self.causal {
            (dim_u32(heads), dim_u32(self.batch), tiles)
        } else {
            (tiles, dim_u32(heads), dim_u32(self.batch))
        }
    }

    fn launch_config(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        threads: i64,
        smem: u32,
    ) -> Result<LaunchConfig, StockReason> {
        self.selected
            .kernels
            .get(kernel)?
            .allow_shared_bytes(smem)
            .map_err(|e| super::launch_failed(self.selected.variant, e))?;
        Ok(LaunchConfig {
            grid_dim: grid,
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: smem,
        })
    }

    /// `plan` bounds the sizes to i32.
    fn problem(&self) -> Problem {
        Problem {
            heads: self.heads as i32,
            lq: self.lq as i32,
            lk: self.lk as i32,
            group: (self.heads / self.kv_heads) as i32,
            scale_log2: (self.scale * std::f64::consts::LOG2_E) as f32,
            scale: self.scale as f32,
            causal: i32::from(self.causal),
            batch: self.batch as i32,
        }
    }

    /// The forward's grid, and whether it is persistent: a CTA per tile of query rows
    /// (`grid`), or with FWD_PERSISTENT and more tiles than fit on the GPU at once, as many
    /// CTAs as fit, handing the tiles out by a counter.
    fn fwd_grid(&self) -> Result<((u32, u32, u32), bool), StockReason> {
        let s = &self.shapes;
        let m_tiles = gpu::grid_dim(self.lq, s.fwd_block_m())?;
        let per_tile = Ok((self.grid(m_tiles, self.heads), false));
        if !s.fwd_persistent {
            return per_tile;
        }
        let k = self.selected.kernels.get(FWD)?;
        // The occupancy query counts the shared memory only once the kernel may use it.
        k.allow_shared_bytes(s.fwd_smem())
            .map_err(|e| super::launch_failed(self.selected.variant, e))?;
        let resident = k.resident_per_sm_with(s.fwd_threads() as u32, s.fwd_smem());
        let ctas = i64::from(resident * self.selected.gpu.multiprocessors);
        if ctas >= i64::from(m_tiles) * self.heads * self.batch {
            return per_tile;
        }
        Ok(((u32::try_from(ctas).unwrap_or(u32::MAX), 1, 1), true))
    }

    /// Output [B, H, Lq, D] and logsumexp [B, H, Lq] (fp32, natural log).
    ///
    /// # Safety
    /// `call` is the call this plan was made for.
    unsafe fn forward(
        &self,
        launch: Launch,
        call: &TfAttentionCall,
    ) -> Result<(Tensor, Tensor), StockReason> {
        let (q, k, v) = operands(call).ok_or(StockReason::InvalidInput)?;
        let out = empty_like_flash(q, self.kind, self.device)?;
        let lse = empty(&[self.batch, self.heads, self.lq], Kind::Float, self.device)?;
        let s = &self.shapes;
        let (qp, kp, vp, op, lp) = (
            q.addr(),
            k.addr(),
            v.addr(),
            device_addr(&out),
            device_addr(&lse),
        );
        let (qs, ks, vs, os) = (
            Strides::of(q.strides()),
            Strides::of(k.strides()),
            Strides::of(v.strides()),
            Strides::of(&out.stride()),
        );
        let problem = self.problem();
        let stream = self.selected.gpu.stream(launch);
        // The persistent forward's tile counter, zeroed on the stream before the launch; none
        // (a null pointer) when the grid has a CTA per tile.
        let (grid, persistent) = self.fwd_grid()?;
        let config = self.launch_config(FWD, grid, s.fwd_threads(), s.fwd_smem())?;
        let counter = persistent
            .then(|| empty(&[1], Kind::Int, self.device))
            .transpose()?;
        let counter_ptr = counter.as_ref().map_or(0, device_addr);
        if counter.is_some() {
            // SAFETY: the counter is 4 bytes of device memory that live until the stream is
            // done with it; the memset is ordered before the launch on the same stream.
            unsafe {
                cudarc::driver::result::memset_d8_async(counter_ptr, 0, 4, stream.cu_stream())
            }
            .map_err(|e| super::launch_failed(self.selected.variant, e))?;
        }
        let mut args = stream.launch_builder(&self.selected.kernels.get(FWD)?.function);
        args.arg(&qp)
            .arg(&qs)
            .arg(&kp)
            .arg(&ks)
            .arg(&vp)
            .arg(&vs)
            .arg(&op)
            .arg(&os)
            .arg(&lp)
            .arg(&problem)
            .arg(&counter_ptr);
        let maps = if s.fwd_tma {
            let (query_rows, keys) = (s.fwd_block_m() as u32, s.fwd_block_n as u32);
            Some([
                tma_map(q, self.kind, query_rows)?,
                tma_map(k, self.kind, keys)?,
                tma_map(v, self.kind, keys)?,
            ])
        } else {
            None
        };
        if let Some(maps) = &maps {
            args.arg(&maps[0]).arg(&maps[1]).arg(&maps[2]);
        }
        // SAFETY: arguments match attn_fwd; q/k/v/out are [B, H(k), L, D] with the given
        // strides and 16-byte aligned rows, lse [B, H, Lq] contiguous; the tensor maps describe
        // q, k and v; all outlive the launch.
        unsafe { args.launch(config) }
            .map_err(|e| super::launch_failed(self.selected.variant, e))?;
        Ok((out, lse))
    }

    /// dq, dk, dv in the layouts stock's flash backward returns.
    ///
    /// # Safety
    /// As `forward`; the call's `grad_out`, `output` and `logsumexp` are present.
    unsafe fn backward(
        &self,
        launch: Launch,
        call: &TfAttentionCall,
    ) -> Result<[Tensor; 3], StockReason> {
        let (q, k, v) = operands(call).ok_or(StockReason::InvalidInput)?;
        let (Some(dout), Some(out), Some(lse)) = (
            call.grad_out.given(),
            call.output.given(),
            call.logsumexp.given(),
        ) else {
            return Err(StockReason::InvalidInput);
        };
        for t in [dout, out] {
            if t.sizes() != q.sizes() || t.kind() != Some(self.kind) || t.device() != self.device {
                return Err(StockReason::InvalidInput);
            }
            if !kernel_layout(t) {
                return Err(StockReason::NoVariantForShape);
            }
        }
        if lse.sizes() != [self.batch, self.heads, self.lq]
            || lse.kind() != Some(Kind::Float)
            || lse.device() != self.device
        {
            return Err(StockReason::InvalidInput);
        }
        let lse = lse.contiguous()?;
        let d = self.shapes.head_dim;
        let s = &self.shapes;
        let delta = empty(&[self.batch, self.heads, self.lq], Kind::Float, self.device)?;
        let dq = empty_like_flash(q, self.kind, self.device)?;
        let dk = empty_like_flash(k, self.kind, self.device)?;
        let dv = empty_like_flash(v, self.kind, self.device)?;

        let rows = self.batch * self.heads * self.lq;
        let prep = self.launch_config(PREP, (gpu::grid_dim(rows * (d / 8), 256)?, 1, 1), 256, 0)?;
        let dkdv = self.launch_config(
            DKDV,
            self.grid(gpu::grid_dim(self.lk, s.dkdv_keys())?, self.kv_heads),
            s.bwd_threads(),
            s.dkdv_smem(),
        )?;
        let dq_config = self.launch_config(
            DQ,
            self.grid(gpu::grid_dim(self.lq, s.dq_rows())?, self.heads),
            s.bwd_threads(),
            s.dq_smem(),
        )?;
        let (qp, kp, vp) = (q.addr(), k.addr(), v.addr());
        let (op, dop, lp, deltap) = (out.addr(), dout.addr(), lse.addr(), device_addr(&delta));
        let (dqp, dkp, dvp) = (device_addr(&dq), device_addr(&dk), device_addr(&dv));
        let (qs, ks, vs, os, dos) = (
            Strides::of(q.strides()),
            Strides::of(k.strides()),
            Strides::of(v.strides()),
            Strides::of(out.strides()),
            Strides::of(dout.strides()),
        );
        let (dqs, dks, dvs) = (
            Strides::of(&dq.stride()),
            Strides::of(&dk.stride()),
            Strides::of(&dv.stride()),
        );
        let problem = self.problem();
        let stream = self.selected.gpu.stream(launch);
        let kernels = &self.selected.kernels;
        let (prep_kernel, dkdv_kernel, dq_kernel) =
            (kernels.get(PREP)?, kernels.get(DKDV)?, kernels.get(DQ)?);
        let failed = |e| super::launch_failed(self.selected.variant, e);

        // The warpgroup kernels' tensor maps, before anything is launched: a map the driver
        // refuses sends the whole backward to stock.
        let (dkdv_maps, dq_maps) = if s.bwd_wgmma {
            let maps = |query_rows: i64, keys: i64| -> Result<[TmaMap; 4], StockReason> {
                let (query_rows, keys) = (query_rows as u32, keys as u32);
                Ok([
                    tma_map(q, self.kind, query_rows)?,
                    tma_map(k, self.kind, keys)?,
                    tma_map(v, self.kind, keys)?,
                    tma_map(dout, self.kind, query_rows)?,
                ])
            };
            (
                Some(maps(s.bwd_block_q, DKDV_WG_KEYS)?),
                Some(maps(DQ_WG_ROWS, s.dq_block_n)?),
            )
        } else {
            (None, None)
        };
        let mut args = stream.launch_builder(&prep_kernel.function);
        let prep_args = PrepArgs {
            o: op,
            os,
            dout: dop,
            ds: dos,
            delta: deltap,
            heads: problem.heads,
            lq: problem.lq,
            rows,
        };
        args::push(&mut args, &prep_args);
        // SAFETY: attn_bwd_prep's parameters are PrepArgs's fields (the compile test checks); out and grad_out are [B, H, Lq, D] with the
        // given strides, delta [B, H, Lq] contiguous.
        unsafe { args.launch(prep) }.map_err(failed)?;

        let inputs = BackwardInputs {
            q: qp,
            qs,
            k: kp,
            ks,
            v: vp,
            vs,
            dout: dop,
            dos,
            lse: lp,
            delta: deltap,
        };
        let mut args = stream.launch_builder(&dkdv_kernel.function);
        inputs.push(&mut args);
        args.arg(&dkp).arg(&dks).arg(&dvp).arg(&dvs).arg(&problem);
        if let Some(maps) = &dkdv_maps {
            args.arg(&maps[0]).arg(&maps[1]).arg(&maps[2]).arg(&maps[3]);
        }
        // SAFETY: arguments match attn_bwd_dkdv; shapes as checked above; the tensor maps
        // describe q, k, v and grad_out.
        unsafe { args.launch(dkdv) }.map_err(failed)?;

        let mut args = stream.launch_builder(&dq_kernel.function);
        inputs.push(&mut args);
        args.arg(&dqp).arg(&dqs).arg(&problem);
        if let Some(maps) = &dq_maps {
            args.arg(&maps[0]).arg(&maps[1]).arg(&maps[2]).arg(&maps[3]);
        }
        // SAFETY: arguments match attn_bwd_dq; shapes as checked above; the tensor maps
        // describe q, k, v and grad_out.
        unsafe { args.launch(dq_config) }.map_err(failed)?;
        Ok([dq, dk, dv])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::REGISTRY;

    #[test]
    fn q_and_k_of_other_last_dims_are_refused_at_the_backend_choice_only() {
        let heads = |d: i64| Tensor::zeros([2, 4, 8, d], (Kind::BFloat16, Device::Cpu));
        let (q, k64, k32) = (heads(64), heads(64), heads(32));
        let call = |q: &Tensor, k: &Tensor| {
            // SAFETY: every field of the C struct is a number or a pointer, for which zero is
            // absent or false; the tensors outlive the calls below.
            let mut call: TfAttentionCall = unsafe { std::mem::zeroed() };
            call.query = crate::abi::tensor::described(q);
            call.key = crate::abi::tensor::described(k);
            call.value = crate::abi::tensor::described(k);
            call
        };
        // SAFETY: the calls' handles are live tensors.
        unsafe {
            let refused = Attention::refuse(Entry::SdpChoice, &call(&q, &k32));
            assert!(refused.is_some_and(|m| m.contains("(64)") && m.contains("(32)")));
            assert_eq!(Attention::refuse(Entry::SdpChoice, &call(&q, &k64)), None);
            assert_eq!(
                Attention::refuse(Entry::FlashAttention, &call(&q, &k32)),
                None
            );
            let mut nested = call(&q, &k32);
            nested.nested = 1;
            assert_eq!(Attention::refuse(Entry::SdpChoice, &nested), None);
        }
    }

    #[test]
    fn no_tile_is_smaller_than_min_tile_rows() {
        // A causal call's length is bounded by 65535 tiles of MIN_TILE_ROWS rows (its grid's
        // third dimension), which holds only if no kernel's tile has fewer rows.
        let allowed = |name: &str| ALLOWED.iter().find(|(p, _)| *p == name).map(|(_, v)| *v);
        let (m_tiles, fwd_warps, bwd_warps) = (
            allowed("FWD_M_TILES").unwrap_or(&[]),
            allowed("FWD_WARPS").unwrap_or(&[]),
            allowed("BWD_WARPS").unwrap_or(&[]),
        );
        assert!(!m_tiles.is_empty() && !fwd_warps.is_empty() && !bwd_warps.is_empty());
        let fewest = m_tiles
            .iter()
            .flat_map(|m| fwd_warps.iter().chain(bwd_warps).map(move |w| 16 * m * w))
            .chain([DKDV_WG_KEYS, DQ_WG_ROWS])
            .min();
        assert_eq!(fewest, Some(MIN_TILE_ROWS));
    }

    fn variant(sm: &str, params: &str) -> Result<crate::ops::Registry, String> {
        crate::ops::parse(&[(
            "t.toml",
            &format!(
                "[[variant]]\nname = \"t\"\nop = \"attention_causal\"\nsource = \"attention.cu\"\n\
                 dtypes = [\"bf16\"]\nsm = {sm}\nhidden = [64, 64]\nparams = {{ HEAD_DIM = 64, {params} }}\n"
            ),
        )])
    }

    #[test]
    fn warpgroup_variants_are_validated() {
        let ok = |sm, params| variant(sm, params).map(|_| ());
        assert_eq!(
            ok(
                "[90, 90]",
                "FWD_WGMMA = 1, FWD_WARPS = 8, FWD_BLOCK_N = 128"
            ),
            Ok(())
        );
        assert_eq!(ok("[90, 90]", "FWD_WGMMA = 1, FWD_STAGES = 3"), Ok(()));
        // wgmma is an sm_90a feature: no other SM may claim the variant.
        let err = ok("[80, 90]", "FWD_WGMMA = 1").unwrap_err();
        assert!(err.contains("sm = [90, 90]"), "{err}");
        // One 64-row tile per warpgroup; 16 rows per warp must fit the K ring for the output.
        for params in [
            "FWD_WGMMA = 1, FWD_M_TILES = 2",
            "FWD_WGMMA = 1, FWD_WARPS = 2",
            "FWD_WGMMA = 1, FWD_BLOCK_N = 32",
        ] {
            let err = ok("[90, 90]", params).unwrap_err();
            assert!(err.contains("FWD_WGMMA takes"), "{params}: {err}");
        }
        // Three computing warpgroups (192 query rows) need the producer's registers.
        assert_eq!(
            ok(
                "[90, 90]",
                "FWD_WGMMA = 1, FWD_TMA = 1, FWD_WARPS = 12, FWD_BLOCK_N = 128"
            ),
            Ok(())
        );
        let err = ok(
            "[90, 90]",
            "FWD_WGMMA = 1, FWD_WARPS = 12, FWD_BLOCK_N = 128",
        )
        .unwrap_err();
        assert!(err.contains("FWD_WARPS 12 takes FWD_TMA"), "{err}");
        let err = ok("[80, 90]", "FWD_WARPS = 12").unwrap_err();
        assert!(err.contains("FWD_WARPS 12 is the warpgroup"), "{err}");
        // The mma.sync forward has its fixed double buffer.
        let err = ok("[80, 90]", "FWD_STAGES = 3").unwrap_err();
        assert!(err.contains("FWD_STAGES"), "{err}");
        assert!(ok("[90, 90]", "FWD_WGMMA = 1, FWD_STAGES = 5").is_err());
    }

    #[test]
    fn warpgroup_forward_shared_memory_has_its_ring_and_alignment_slack() {
        let registry = variant(
            "[90, 90]",
            "FWD_WGMMA = 1, FWD_WARPS = 8, FWD_BLOCK_N = 64, FWD_STAGES = 3",
        )
        .expect("valid");
        let s = registry.params(0).get::<Params>().expect("attention");
        // Q (128 rows) + 3 stages of K and V (64 rows each), 64 bf16 columns, + 1024 bytes.
        assert_eq!(s.fwd_smem(), ((128 + 2 * 3 * 64) * 64 * 2 + 1024) as u32);
        let registry = variant("[80, 90]", "FWD_WARPS = 4, FWD_BLOCK_N = 64").expect("valid");
        let s = registry.params(0).get::<Params>().expect("attention");
        assert_eq!(s.fwd_smem(), ((64 + 4 * 64) * 64 * 2) as u32);
    }

    #[test]
    fn shared_memory_fits_an_sm90_block_for_every_variant() {
        let registry = REGISTRY.as_ref().expect("registry");
        for (i, v) in registry.variants().iter().enumerate() {
            let Some(s) = registry.params(i).get::<Params>() else {
                continue;
            };
            for bytes in [s.fwd_smem(), s.dkdv_smem(), s.dq_smem()] {
                assert!(bytes <= 227 * 1024, "{}: {bytes} bytes", v.name);
            }
        }
    }
}
